// Tensors in CUDA memory read and written where they lie, against the float64
// reference (docs/design.md §4):
//  - the backend: CudaBackend with params.devices set (inputs and outputs in
//    device memory, aligned and misaligned, mixed with host tensors, and on
//    a second device: one peer copy each way);
//  - a real server: the attnserve binary in a child process (an IPC handle
//    cannot be opened by the process that exported it) with a region of
//    this process's cudaMalloc memory registered through KServe v2's
//    CudaSharedMemoryRegister; q, k, v, o and lse in the region; a region on
//    device 1 while the server runs on device 0; attention_kv's q, k and v in
//    the region (a prefill step, O against the reference); a server on the
//    CPU backend refuses such a call naming the tensor and writes nothing.
// Without a GPU every test says SKIPPED; the two-device cases need two.
#include <cuda_runtime.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "attnserve/v1/kv.grpc.pb.h"
#include "backend/backend.h"
#include "common/dtype.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "tests/common/attn_test_util.h"
#include "tests/cuda/shared_cuda_backend.h"

namespace attnserve {
namespace {

using testing_util::CheckOutput;
using testing_util::HostBuffers;
using testing_util::TestCase;

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

// `bytes` of device memory on `device`, `pad` bytes past an aligned start
// (pad 4: a span the kernels cannot read in place).
class DeviceBuffer {
 public:
  DeviceBuffer(int device, int64_t bytes, int64_t pad = 0) : device_(device), pad_(pad) {
    cudaSetDevice(device);
    if (cudaMalloc(&base_, static_cast<size_t>(bytes + pad + 256)) != cudaSuccess) base_ = nullptr;
  }
  ~DeviceBuffer() {
    if (base_ == nullptr) return;
    cudaSetDevice(device_);
    cudaFree(base_);
  }
  bool ok() const { return base_ != nullptr; }
  char* data() const { return static_cast<char*>(base_) + pad_; }
  void Upload(const void* src, int64_t bytes) {
    cudaSetDevice(device_);
    ASSERT_EQ(cudaMemcpy(data(), src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  // Fills with 0xFF (NaN in FP16, BF16 and FP32), so an unwritten output shows.
  void Poison(int64_t bytes) {
    cudaSetDevice(device_);
    ASSERT_EQ(cudaMemset(data(), 0xFF, static_cast<size_t>(bytes)), cudaSuccess);
  }
  std::vector<char> Download(int64_t bytes) const {
    std::vector<char> out(static_cast<size_t>(bytes));
    cudaSetDevice(device_);
    EXPECT_EQ(cudaMemcpy(out.data(), data(), out.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

 private:
  int device_;
  int64_t pad_;
  void* base_ = nullptr;
};

// Where each tensor of a backend case lies: kHostMemory or a device, and
// whether it starts misaligned there.
struct Placement {
  const char* name;
  int q, k, v, o, lse;
  int64_t pad = 0;
};

TestCase Bf16Causal() {
  TestCase tc;
  tc.dtype = DType::kBF16;
  tc.batch = 2;
  tc.seqlen_q = tc.seqlen_k = 97;
  tc.num_heads_q = 4;
  tc.num_heads_kv = 2;
  tc.head_dim = 128;
  tc.causal = true;
  return tc;
}

TestCase Fp16Varlen() {
  TestCase tc;
  tc.dtype = DType::kFP16;
  tc.seqlens_q = {3, 0, 17};
  tc.seqlens_k = {5, 0, 40};
  tc.num_heads_q = 8;
  tc.num_heads_kv = 8;
  tc.head_dim = 128;
  return tc;
}

TestCase Fp32Decode() {
  TestCase tc;
  tc.dtype = DType::kFP32;
  tc.batch = 3;
  tc.seqlen_q = 1;
  tc.seqlen_k = 300;
  tc.num_heads_q = 8;
  tc.num_heads_kv = 1;
  tc.head_dim = 64;
  return tc;
}

TestCase Fp8() {
  TestCase tc = Bf16Causal();
  tc.dtype = DType::kFP8E4M3;
  tc.q_descale = 0.5f;
  tc.k_descale = 2.0f;
  tc.v_descale = 0.25f;
  return tc;
}

// Runs `tc` on the shared backend with its tensors placed as `where` says
// and checks O and LSE.
void RunPlaced(const TestCase& tc, const Placement& where) {
  std::string why;
  AttentionBackend* backend = testing_util::SharedCudaBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  for (int d : {where.q, where.k, where.v, where.o, where.lse}) {
    if (d >= DeviceCount()) GTEST_SKIP() << "needs device " << d;
  }
  SCOPED_TRACE(absl::StrCat(tc.Name(), " ", where.name));
  HostBuffers buf(tc);
  AttnParams p = buf.params();
  std::vector<std::unique_ptr<DeviceBuffer>> held;
  auto place = [&](int device, const void* host, int64_t bytes) -> char* {
    held.push_back(std::make_unique<DeviceBuffer>(device, bytes, where.pad));
    EXPECT_TRUE(held.back()->ok());
    if (host != nullptr) held.back()->Upload(host, bytes);
    return held.back()->data();
  };
  const int64_t lse_bytes = buf.lse_elements() * 4;
  DeviceBuffer* o_dev = nullptr;
  DeviceBuffer* lse_dev = nullptr;
  if (where.q != kHostMemory) p.q = place(where.q, buf.q(), buf.q_bytes());
  if (where.k != kHostMemory) p.k = place(where.k, buf.k(), buf.kv_bytes());
  if (where.v != kHostMemory) p.v = place(where.v, buf.v(), buf.kv_bytes());
  if (where.o != kHostMemory) {
    p.o = place(where.o, nullptr, buf.o_bytes());
    o_dev = held.back().get();
    o_dev->Poison(buf.o_bytes());
  }
  if (where.lse != kHostMemory) {
    p.lse = reinterpret_cast<float*>(place(where.lse, nullptr, lse_bytes));
    lse_dev = held.back().get();
    lse_dev->Poison(lse_bytes);
  }
  p.devices = {where.q, where.k, where.v, where.o, where.lse};
  buf.Poison();
  BackendTimings timings;
  const absl::Status st = PlanAndForward(*backend, p, &timings);
  ASSERT_TRUE(st.ok()) << st;
  std::vector<char> o = o_dev != nullptr
                            ? o_dev->Download(buf.o_bytes())
                            : std::vector<char>(static_cast<const char*>(buf.o()),
                                                static_cast<const char*>(buf.o()) + buf.o_bytes());
  std::vector<char> lse = lse_dev != nullptr ? lse_dev->Download(lse_bytes) : std::vector<char>();
  const float* lse_host =
      lse_dev != nullptr ? reinterpret_cast<const float*>(lse.data()) : buf.lse();
  EXPECT_TRUE(CheckOutput(buf, o.data(), lse_host));
}

const Placement kPlacements[] = {
    {"all_on_device", 0, 0, 0, 0, 0},
    {"all_on_device_misaligned", 0, 0, 0, 0, 0, 4},
    {"mixed", 0, kHostMemory, 0, kHostMemory, 0},
    {"outputs_only", kHostMemory, kHostMemory, kHostMemory, 0, 0},
    {"peer_inputs", 1, 1, 1, 0, 0},
    {"peer_outputs", 0, 0, 0, 1, 1},
};

TEST(CudaDeviceTensorsTest, MatchReferenceWherePlaced) {
  for (const TestCase& tc : {Bf16Causal(), Fp16Varlen(), Fp32Decode(), Fp8()}) {
    for (const Placement& where : kPlacements) {
      if (DeviceCount() < 2 && (where.q == 1 || where.o == 1)) continue;  // SKIPPED below
      RunPlaced(tc, where);
      if (HasFatalFailure() || IsSkipped()) return;
    }
  }
  if (DeviceCount() < 2) GTEST_SKIP() << "the peer placements need two GPUs (ran the others)";
}

// Host inputs in page-locked memory (what a system region is on a CUDA
// server: ShmRegistry pins it at registration) go to the device straight
// from there, with no copy into the staging buffer: all three, and k alone
// (the staged ranges around its place).
TEST(CudaDeviceTensorsTest, PageLockedHostInputsMatchReference) {
  std::string why;
  AttentionBackend* backend = testing_util::SharedCudaBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  for (const TestCase& tc : {Bf16Causal(), Fp16Varlen()}) {
    for (const bool k_only : {false, true}) {
      SCOPED_TRACE(absl::StrCat(tc.Name(), k_only ? " k only" : " q, k and v"));
      HostBuffers buf(tc);
      AttnParams p = buf.params();
      // One page-aligned block (pinned ranges must not overlap), each
      // tensor at a page boundary in it.
      constexpr size_t kPage = 4096;
      auto room = [](int64_t bytes) {
        return (static_cast<size_t>(bytes) + kPage - 1) / kPage * kPage;
      };
      const size_t q_at = 0, k_at = room(buf.q_bytes()), v_at = k_at + room(buf.kv_bytes());
      const size_t total = v_at + room(buf.kv_bytes());
      std::unique_ptr<char, decltype(&std::free)> block(
          static_cast<char*>(std::aligned_alloc(kPage, total)), &std::free);
      ASSERT_NE(block, nullptr);
      std::memcpy(block.get() + q_at, buf.q(), buf.q_bytes());
      std::memcpy(block.get() + k_at, buf.k(), buf.kv_bytes());
      std::memcpy(block.get() + v_at, buf.v(), buf.kv_bytes());
      ASSERT_EQ(cudaHostRegister(block.get(), total, cudaHostRegisterPortable), cudaSuccess);
      cudaPointerAttributes attr{};
      ASSERT_EQ(cudaPointerGetAttributes(&attr, block.get() + k_at), cudaSuccess);
      EXPECT_EQ(attr.type, cudaMemoryTypeHost);  // what the staging path looks for
      if (!k_only) p.q = block.get() + q_at;
      p.k = block.get() + k_at;
      if (!k_only) p.v = block.get() + v_at;
      buf.Poison();
      BackendTimings timings;
      const absl::Status st = PlanAndForward(*backend, p, &timings);
      EXPECT_EQ(cudaHostUnregister(block.get()), cudaSuccess);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_TRUE(CheckOutput(buf, buf.o(), buf.lse()));
    }
  }
}

// A call with device tensors never joins a packed launch.
TEST(CudaDeviceTensorsTest, NeverShareALaunch) {
  HostBuffers a(Bf16Causal()), b(Bf16Causal());
  AttnParams device_q = a.params();
  device_q.devices.q = 0;
  EXPECT_TRUE(CanShareLaunch(a.params(), b.params()));
  EXPECT_FALSE(CanShareLaunch(device_q, b.params()));
  EXPECT_FALSE(CanShareLaunch(b.params(), device_q));
}

// --- Through a real server ---

std::string BinaryPath() {
  const char* env = std::getenv("ATTNSERVE_BINARY");
  return env != nullptr && env[0] != '\0' ? env : ATTNSERVE_BINARY;
}

// A child attnserve; its output is read until it listens, then drained by
// a thread (so its logging never blocks on a full pipe).
class ServerProcess {
 public:
  explicit ServerProcess(std::vector<std::string> flags) {
    int fds[2];
    if (pipe(fds) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], STDOUT_FILENO);
      dup2(fds[1], STDERR_FILENO);
      close(fds[0]);
      close(fds[1]);
      std::vector<std::string> args = {BinaryPath(),    "--host=127.0.0.1",
                                       "--port=0",      "--metrics_port=0",
                                       "--http_port=0", "--allow_client_shm"};
      args.insert(args.end(), flags.begin(), flags.end());
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(fds[1]);
    out_ = fdopen(fds[0], "r");
    char line[4096];
    while (out_ != nullptr && fgets(line, sizeof(line), out_) != nullptr) {
      log_ += line;
      const std::string s(line);
      const size_t at = s.find("listening on 127.0.0.1:");
      if (at == std::string::npos) continue;
      const size_t start = at + std::string("listening on 127.0.0.1:").size();
      if (!absl::SimpleAtoi(s.substr(start, s.find(' ', start) - start), &port_)) port_ = 0;
      break;
    }
    drain_ = std::thread([this] {
      char buf[4096];
      while (out_ != nullptr && fgets(buf, sizeof(buf), out_) != nullptr) {
      }
    });
  }
  ~ServerProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (drain_.joinable()) drain_.join();
    if (out_ != nullptr) fclose(out_);
  }
  int port() const { return port_; }
  const std::string& log() const { return log_; }

 private:
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  int port_ = 0;
  std::string log_;
  std::thread drain_;
};

// One call's tensors in one region of this process's device memory:
// q | k | v | o | lse, each 256-byte aligned.
struct RegionLayout {
  int64_t q = 0, k = 0, v = 0, o = 0, lse = 0, end = 0;
  explicit RegionLayout(const HostBuffers& buf) {
    auto take = [this](int64_t bytes) {
      const int64_t at = end;
      end += (bytes + 255) / 256 * 256;
      return at;
    };
    q = take(buf.q_bytes());
    k = take(buf.kv_bytes());
    v = take(buf.kv_bytes());
    o = take(buf.o_bytes());
    lse = take(buf.lse_elements() * 4);
  }
};

void PlaceInRegion(google::protobuf::Map<std::string, inference::InferParameter>* p,
                   const std::string& region, int64_t offset, int64_t size) {
  (*p)["shared_memory_region"].set_string_param(region);
  (*p)["shared_memory_offset"].set_int64_param(offset);
  (*p)["shared_memory_byte_size"].set_int64_param(size);
}

class CudaShmServerTest : public ::testing::Test {
 protected:
  // Starts a server with `flags`; skips without a GPU (or a second one).
  void Start(std::vector<std::string> flags, int devices_needed = 1) {
    if (DeviceCount() < devices_needed) {
      GTEST_SKIP() << "needs " << devices_needed << " GPU(s), found " << DeviceCount();
    }
    server_ = std::make_unique<ServerProcess>(std::move(flags));
    ASSERT_GT(server_->port(), 0) << server_->log();
    stub_ = inference::GRPCInferenceService::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials()));
  }

  grpc::Status Register(const std::string& name, const DeviceBuffer& memory, int device,
                        int64_t bytes) {
    cudaSetDevice(device);
    cudaIpcMemHandle_t handle;
    EXPECT_EQ(cudaIpcGetMemHandle(&handle, memory.data()), cudaSuccess);
    inference::CudaSharedMemoryRegisterRequest request;
    request.set_name(name);
    request.set_raw_handle(std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)));
    request.set_device_id(device);
    request.set_byte_size(static_cast<uint64_t>(bytes));
    inference::CudaSharedMemoryRegisterResponse response;
    grpc::ClientContext context;
    return stub_->CudaSharedMemoryRegister(&context, request, &response);
  }

  // The v2 request of `buf`'s dense call with every tensor in region `name`.
  static inference::ModelInferRequest RequestInRegion(const HostBuffers& buf,
                                                      const RegionLayout& at,
                                                      const std::string& name) {
    const TestCase& tc = buf.test_case();
    inference::ModelInferRequest r;
    r.set_model_name("attention");
    const std::string dtype(DTypeName(tc.dtype));
    const std::pair<const char*, std::vector<int64_t>> inputs[] = {
        {"q", {tc.batch, tc.seqlen_q, tc.num_heads_q, tc.head_dim}},
        {"k", {tc.batch, tc.seqlen_k, tc.num_heads_kv, tc.head_dim}},
        {"v", {tc.batch, tc.seqlen_k, tc.num_heads_kv, tc.head_dim}}};
    const int64_t offsets[] = {at.q, at.k, at.v};
    const int64_t sizes[] = {buf.q_bytes(), buf.kv_bytes(), buf.kv_bytes()};
    for (int i = 0; i < 3; ++i) {
      auto* in = r.add_inputs();
      in->set_name(inputs[i].first);
      in->set_datatype(dtype);
      for (int64_t d : inputs[i].second) in->add_shape(d);
      PlaceInRegion(in->mutable_parameters(), name, offsets[i], sizes[i]);
    }
    if (tc.causal) (*r.mutable_parameters())["causal"].set_bool_param(true);
    auto* o = r.add_outputs();
    o->set_name("o");
    PlaceInRegion(o->mutable_parameters(), name, at.o, buf.o_bytes());
    auto* lse = r.add_outputs();
    lse->set_name("lse");
    PlaceInRegion(lse->mutable_parameters(), name, at.lse, buf.lse_elements() * 4);
    return r;
  }

  grpc::Status Infer(const inference::ModelInferRequest& request,
                     inference::ModelInferResponse* response) {
    grpc::ClientContext context;
    return stub_->ModelInfer(&context, request, response);
  }

  // A dense call with q, k, v, o and lse in a region on `region_device`:
  // OK and the reference's O and LSE in the region, or `expected` refused.
  void RoundTrip(int region_device, grpc::StatusCode expected = grpc::StatusCode::OK,
                 const std::string& message_part = "") {
    TestCase tc;
    tc.dtype = DType::kBF16;
    tc.batch = 2;
    tc.seqlen_q = tc.seqlen_k = 256;
    tc.num_heads_q = 8;
    tc.num_heads_kv = 2;
    tc.head_dim = 128;
    tc.causal = true;
    HostBuffers buf(tc);
    const RegionLayout at(buf);
    DeviceBuffer memory(region_device, at.end);
    ASSERT_TRUE(memory.ok());
    memory.Poison(at.end);
    memory.Upload(buf.q(), buf.q_bytes());
    cudaSetDevice(region_device);
    ASSERT_EQ(cudaMemcpy(memory.data() + at.k, buf.k(), buf.kv_bytes(), cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(memory.data() + at.v, buf.v(), buf.kv_bytes(), cudaMemcpyHostToDevice),
              cudaSuccess);
    const std::string name = absl::StrCat("region", region_device);
    const grpc::Status registered = Register(name, memory, region_device, at.end);
    ASSERT_TRUE(registered.ok()) << registered.error_message() << "\n" << server_->log();

    inference::ModelInferResponse response;
    const grpc::Status st = Infer(RequestInRegion(buf, at, name), &response);
    const std::vector<char> region = memory.Download(at.end);
    if (expected != grpc::StatusCode::OK) {
      EXPECT_EQ(st.error_code(), expected) << st.error_message();
      EXPECT_NE(st.error_message().find(message_part), std::string::npos) << st.error_message();
      // Nothing written: O is still the poison.
      for (int64_t i = 0; i < buf.o_bytes(); ++i) {
        ASSERT_EQ(static_cast<unsigned char>(region[static_cast<size_t>(at.o + i)]), 0xFF) << i;
      }
      return;
    }
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(response.outputs_size(), 2);
    for (const std::string& raw : response.raw_output_contents()) EXPECT_TRUE(raw.empty());
    EXPECT_EQ(response.parameters().at("device").int64_param(), 0);
    EXPECT_TRUE(CheckOutput(buf, region.data() + at.o,
                            reinterpret_cast<const float*>(region.data() + at.lse)));
  }

  // attention_kv: one prefill step of a new sequence of cache `cache` (made
  // here) with q, k and v in a region on `region_device`; O and LSE come in
  // the response.
  void KvStep(int region_device) {
    TestCase tc;
    tc.dtype = DType::kBF16;
    tc.batch = 1;
    tc.seqlen_q = tc.seqlen_k = 200;
    tc.num_heads_q = 8;
    tc.num_heads_kv = 2;
    tc.head_dim = 128;
    tc.causal = true;
    HostBuffers buf(tc);
    auto kv = v1::KvCache::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                                       grpc::InsecureChannelCredentials()));
    v1::CreateCacheRequest create;
    create.mutable_geometry()->set_num_layers(1);
    create.mutable_geometry()->set_num_heads_kv(tc.num_heads_kv);
    create.mutable_geometry()->set_head_dim(tc.head_dim);
    create.mutable_geometry()->set_dtype(v1::BF16);
    create.set_capacity_tokens(4096);
    const std::string cache_id = absl::StrCat("kv", region_device);
    create.set_cache_id(cache_id);
    v1::CreateCacheResponse created;
    grpc::ClientContext create_context;
    const grpc::Status made = kv->CreateCache(&create_context, create, &created);
    ASSERT_TRUE(made.ok()) << made.error_message();

    const RegionLayout at(buf);
    DeviceBuffer memory(region_device, at.end);
    ASSERT_TRUE(memory.ok());
    memory.Upload(buf.q(), buf.q_bytes());
    cudaSetDevice(region_device);
    ASSERT_EQ(cudaMemcpy(memory.data() + at.k, buf.k(), buf.kv_bytes(), cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(memory.data() + at.v, buf.v(), buf.kv_bytes(), cudaMemcpyHostToDevice),
              cudaSuccess);
    const std::string name = absl::StrCat("kvregion", region_device);
    const grpc::Status registered = Register(name, memory, region_device, at.end);
    ASSERT_TRUE(registered.ok()) << registered.error_message();

    inference::ModelInferRequest r;
    r.set_model_name("attention_kv");
    const std::string dtype(DTypeName(tc.dtype));
    const std::pair<const char*, std::vector<int64_t>> inputs[] = {
        {"q", {tc.seqlen_q, tc.num_heads_q, tc.head_dim}},
        {"k", {tc.seqlen_k, tc.num_heads_kv, tc.head_dim}},
        {"v", {tc.seqlen_k, tc.num_heads_kv, tc.head_dim}}};
    const int64_t offsets[] = {at.q, at.k, at.v};
    const int64_t sizes[] = {buf.q_bytes(), buf.kv_bytes(), buf.kv_bytes()};
    for (int i = 0; i < 3; ++i) {
      auto* in = r.add_inputs();
      in->set_name(inputs[i].first);
      in->set_datatype(dtype);
      for (int64_t d : inputs[i].second) in->add_shape(d);
      PlaceInRegion(in->mutable_parameters(), name, offsets[i], sizes[i]);
    }
    auto& params = *r.mutable_parameters();
    params["cache_id"].set_string_param(cache_id);
    params["sequence_id"].set_uint64_param(1);
    params["sequence_start"].set_bool_param(true);
    params["causal"].set_bool_param(true);
    r.add_outputs()->set_name("o");
    r.add_outputs()->set_name("lse");
    inference::ModelInferResponse response;
    const grpc::Status st = Infer(r, &response);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(response.raw_output_contents_size(), 2);
    ASSERT_EQ(static_cast<int64_t>(response.raw_output_contents(0).size()), buf.o_bytes());
    EXPECT_EQ(response.parameters().at("sequence_length").int64_param(), tc.seqlen_k);
    EXPECT_TRUE(
        CheckOutput(buf, response.raw_output_contents(0).data(),
                    reinterpret_cast<const float*>(response.raw_output_contents(1).data())));
  }

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> stub_;
};

TEST_F(CudaShmServerTest, KserveReadsAndWritesTheRegionOnItsDevice) {
  Start({"--backend=cuda", "--devices=0"});
  if (IsSkipped() || HasFatalFailure()) return;
  RoundTrip(0);
}

TEST_F(CudaShmServerTest, KserveRegionOnAnotherDevice) {
  Start({"--backend=cuda", "--devices=0"}, /*devices_needed=*/2);
  if (IsSkipped() || HasFatalFailure()) return;
  RoundTrip(1);
}

TEST_F(CudaShmServerTest, KserveKvReadsItsInputsOnTheDevice) {
  Start({"--backend=cuda", "--devices=0"});
  if (IsSkipped() || HasFatalFailure()) return;
  KvStep(0);
}

TEST_F(CudaShmServerTest, KserveKvInputsOnAnotherDevice) {
  Start({"--backend=cuda", "--devices=0"}, /*devices_needed=*/2);
  if (IsSkipped() || HasFatalFailure()) return;
  KvStep(1);
}

TEST_F(CudaShmServerTest, CpuServerRefusesCudaRegionsCleanly) {
  Start({"--backend=cpu", "--threads=2"});
  if (IsSkipped() || HasFatalFailure()) return;
  RoundTrip(0, grpc::StatusCode::UNIMPLEMENTED, "q is memory of CUDA device 0");
}

}  // namespace
}  // namespace attnserve
