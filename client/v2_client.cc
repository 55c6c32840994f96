// V2Client and the ForwardRequest <-> ModelInferRequest conversions; see
// v2_client.h.
#include "client/v2_client.h"

#include <fcntl.h>
#include <grpcpp/client_context.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/async_unary.h"
#include "common/dtype.h"
#include "common/status_macros.h"

#if ATTNSERVE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace attnserve {
namespace {

// INT32 values as the v2 protocol's little-endian bytes: their own memory on
// this (little-endian) host.
absl::string_view Int32Bytes(const google::protobuf::RepeatedField<int32_t>& values) {
  return absl::string_view(reinterpret_cast<const char*>(values.data()),
                           values.size() * sizeof(int32_t));
}

// FP32 values likewise.
absl::string_view Fp32Bytes(const google::protobuf::RepeatedField<float>& values) {
  return absl::string_view(reinterpret_cast<const char*>(values.data()),
                           values.size() * sizeof(float));
}

// The v2 tensors of a request, in order: name, datatype, shape, bytes (a view
// of the request's own: a large request's tensors are never copied just to
// be described).
struct V2Input {
  const char* name;
  std::string datatype;
  std::vector<int64_t> shape;
  absl::string_view bytes;
};

std::vector<V2Input> InputsOf(const v1::ForwardRequest& r) {
  std::vector<V2Input> inputs;
  const std::pair<const char*, const v1::Tensor*> tensors[] = {
      {"q", &r.q()}, {"k", &r.k()}, {"v", &r.v()}};
  for (const auto& [name, t] : tensors) {
    inputs.push_back({name,
                      std::string(DTypeName(static_cast<DType>(t->dtype()))),
                      {t->shape().begin(), t->shape().end()},
                      t->data()});
  }
  if (r.cu_seqlens_q_size() > 0 || r.cu_seqlens_k_size() > 0) {
    inputs.push_back(
        {"cu_seqlens_q", "INT32", {r.cu_seqlens_q_size()}, Int32Bytes(r.cu_seqlens_q())});
    inputs.push_back(
        {"cu_seqlens_k", "INT32", {r.cu_seqlens_k_size()}, Int32Bytes(r.cu_seqlens_k())});
  }
  // Score modifiers and masks: optional inputs of the same names
  // (docs/kserve.md); the block mask's sizes go as parameters (SetParameters).
  const v1::AttentionOptions& o = r.options();
  if (o.alibi_slopes_size() > 0) {
    inputs.push_back(
        {"alibi_slopes", "FP32", {o.alibi_slopes_size()}, Fp32Bytes(o.alibi_slopes())});
  }
  if (o.sinks_size() > 0) {
    inputs.push_back({"sinks", "FP32", {o.sinks_size()}, Fp32Bytes(o.sinks())});
  }
  if (o.has_bias()) {
    inputs.push_back({"bias",
                      std::string(DTypeName(static_cast<DType>(o.bias().dtype()))),
                      {o.bias().shape().begin(), o.bias().shape().end()},
                      o.bias().data()});
  }
  if (o.has_mask()) {
    inputs.push_back(
        {"mask", "BOOL", {o.mask().shape().begin(), o.mask().shape().end()}, o.mask().data()});
  }
  if (o.has_block_mask()) {
    const v1::BlockMask& m = o.block_mask();
    inputs.push_back({"block_row_ptr", "INT32", {m.row_ptr_size()}, Int32Bytes(m.row_ptr())});
    inputs.push_back({"block_col_idx", "INT32", {m.col_idx_size()}, Int32Bytes(m.col_idx())});
  }
  return inputs;
}

// Bytes of o: q's with V's head dim (they differ for MLA shapes).
int64_t OBytes(const v1::ForwardRequest& r) {
  const int64_t q = static_cast<int64_t>(r.q().data().size());
  const int n = r.q().shape_size();
  if (n == 0 || r.v().shape_size() != n || r.q().shape(n - 1) <= 0) return q;
  return q / r.q().shape(n - 1) * r.v().shape(n - 1);
}

// Bytes of lse for q: FP32, one per query row and head.
int64_t LseBytes(const v1::Tensor& q) {
  int64_t rows_heads = 1;
  for (int i = 0; i + 1 < q.shape_size(); ++i) rows_heads *= q.shape(i);
  return rows_heads * 4;
}

void SetParameters(const v1::AttentionOptions& o, inference::ModelInferRequest* out) {
  auto& p = *out->mutable_parameters();
  if (o.causal()) p["causal"].set_bool_param(true);
  if (o.has_window_left()) p["window_left"].set_int64_param(o.window_left());
  if (o.has_window_right()) p["window_right"].set_int64_param(o.window_right());
  if (o.softcap() != 0.0f) p["softcap"].set_double_param(o.softcap());
  if (o.has_softmax_scale()) p["softmax_scale"].set_double_param(o.softmax_scale());
  if (o.return_lse()) p["return_lse"].set_bool_param(true);
  if (o.has_block_mask()) {
    const v1::BlockMask& m = o.block_mask();
    p["block_q"].set_int64_param(m.block_q());
    p["block_k"].set_int64_param(m.block_k());
    p["block_num_batch"].set_int64_param(m.num_batch());
    p["block_num_heads"].set_int64_param(m.num_heads());
  }
}

// A v2 output as a native tensor: its datatype, shape and `bytes`.
absl::StatusOr<v1::Tensor> TensorOf(const inference::ModelInferResponse::InferOutputTensor& out,
                                    std::string bytes) {
  v1::Tensor t;
  const std::string& type = out.datatype();
  const DType dtype = type == "FP16" ? DType::kFP16 : type == "BF16" ? DType::kBF16 : DType::kFP32;
  if (type != "FP16" && type != "BF16" && type != "FP32") {
    return absl::InternalError(absl::StrCat(
        "outputs['", out.name(), "'].datatype: expected FP16, BF16 or FP32, got \"", type, "\""));
  }
  t.set_dtype(static_cast<v1::DType>(dtype));
  *t.mutable_shape() = out.shape();
  t.set_data(std::move(bytes));
  return t;
}

// Bytes an output of this shape and datatype has.
int64_t BytesOf(const inference::ModelInferResponse::InferOutputTensor& out) {
  int64_t n = out.datatype() == "FP32" ? 4 : 2;
  for (int64_t d : out.shape()) n *= d;
  return n;
}

}  // namespace

inference::ModelInferRequest ToModelInferRequest(const v1::ForwardRequest& request) {
  inference::ModelInferRequest out;
  out.set_model_name(kV2AttentionModel);
  out.set_id(request.request_id());
  for (V2Input& in : InputsOf(request)) {
    auto* t = out.add_inputs();
    t->set_name(in.name);
    t->set_datatype(in.datatype);
    for (int64_t d : in.shape) t->add_shape(d);
    out.add_raw_input_contents(std::string(in.bytes));
  }
  SetParameters(request.options(), &out);
  out.add_outputs()->set_name("o");
  if (request.options().return_lse()) out.add_outputs()->set_name("lse");
  return out;
}

absl::StatusOr<v1::ForwardResponse> FromModelInferResponse(
    inference::ModelInferResponse&& response) {
  v1::ForwardResponse out;
  out.set_request_id(response.id());
  for (int i = 0; i < response.outputs_size(); ++i) {
    const auto& meta = response.outputs(i);
    if (i >= response.raw_output_contents_size()) {
      return absl::InternalError(
          absl::StrCat("outputs['", meta.name(), "']: no raw_output_contents entry"));
    }
    absl::StatusOr<v1::Tensor> t =
        TensorOf(meta, std::move(*response.mutable_raw_output_contents(i)));
    if (!t.ok()) return t.status();
    if (meta.name() == "o") *out.mutable_o() = *std::move(t);
    if (meta.name() == "lse") *out.mutable_lse() = *std::move(t);
  }
  const auto& p = response.parameters();
  auto get = [&](const char* name) -> int64_t {
    auto it = p.find(name);
    return it == p.end() ? 0 : it->second.int64_param();
  };
  v1::ServerTiming* timing = out.mutable_timing();
  timing->set_queue_us(get("queue_us"));
  timing->set_compute_us(get("compute_us"));
  timing->set_total_us(get("total_us"));
  timing->set_batch_size(static_cast<int32_t>(get("batch_size")));
  timing->set_device(static_cast<int32_t>(get("device")));
  if (auto it = p.find("backend"); it != p.end()) out.set_backend(it->second.string_param());
  return out;
}

int64_t V2SlotBytes(const v1::ForwardRequest& request) {
  int64_t bytes = 0;
  for (const V2Input& in : InputsOf(request)) bytes += static_cast<int64_t>(in.bytes.size());
  bytes += OBytes(request);
  if (request.options().return_lse()) bytes += LseBytes(request.q());
  return bytes;
}

// One registered region: where a slot's tensors go, and how the client
// reaches them.
struct V2Client::Region {
  std::string name;  // the registered name
  int64_t size = 0;
  int staged_input = -1;  // ForwardStaged's input whose bytes the region holds; -1: none
  virtual ~Region() = default;
  virtual absl::Status Write(int64_t offset, absl::string_view bytes) = 0;
  virtual absl::Status Read(int64_t offset, int64_t bytes, std::string* out) = 0;
};

namespace {

// A POSIX shm object mapped here, removed with the region.
struct SystemRegion final : V2Client::Region {
  std::string key;  // shm_open's name
  char* data = nullptr;
  ~SystemRegion() override {
    if (data != nullptr) munmap(data, static_cast<size_t>(size));
    shm_unlink(key.c_str());
  }
  absl::Status Write(int64_t offset, absl::string_view bytes) override {
    if (!bytes.empty()) std::memcpy(data + offset, bytes.data(), bytes.size());
    return absl::OkStatus();
  }
  absl::Status Read(int64_t offset, int64_t bytes, std::string* out) override {
    out->assign(data + offset, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
};

absl::StatusOr<std::unique_ptr<V2Client::Region>> MakeSystemRegion(const std::string& key_prefix,
                                                                   const std::string& name,
                                                                   int64_t size) {
  auto region = std::make_unique<SystemRegion>();
  region->name = name;
  region->size = size;
  region->key = key_prefix + name;
  const int fd = shm_open(region->key.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    const int error = errno;
    region->key.clear();  // not ours to unlink
    return absl::InternalError(
        absl::StrCat("--shm=system: shm_open ", name, ": ", std::strerror(error)));
  }
  void* p = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(size)) == 0) {
    p = mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  const int error = errno;
  close(fd);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "--shm=system: cannot map ", size, " bytes of /", name, ": ", std::strerror(error)));
  }
  region->data = static_cast<char*>(p);
  return std::unique_ptr<V2Client::Region>(std::move(region));
}

#if ATTNSERVE_HAVE_CUDA
// Device memory of this process, exported to the server as a CUDA IPC handle.
struct CudaRegion final : V2Client::Region {
  char* data = nullptr;  // device pointer
  int device = 0;
  std::string handle;  // the cudaIpcMemHandle_t's bytes
  ~CudaRegion() override {
    if (data == nullptr) return;
    cudaSetDevice(device);
    cudaFree(data);
  }
  absl::Status Check(cudaError_t err, const char* what) {
    if (err == cudaSuccess) return absl::OkStatus();
    return absl::InternalError(
        absl::StrCat("--shm=cuda: ", what, " failed: ", cudaGetErrorString(err)));
  }
  absl::Status Write(int64_t offset, absl::string_view bytes) override {
    return Check(cudaMemcpy(data + offset, bytes.data(), bytes.size(), cudaMemcpyHostToDevice),
                 "cudaMemcpy to the region");
  }
  absl::Status Read(int64_t offset, int64_t bytes, std::string* out) override {
    out->resize(static_cast<size_t>(bytes));
    return Check(cudaMemcpy(out->data(), data + offset, out->size(), cudaMemcpyDeviceToHost),
                 "cudaMemcpy from the region");
  }
};

absl::StatusOr<std::unique_ptr<V2Client::Region>> MakeCudaRegion(const std::string& name,
                                                                 int64_t size) {
  auto region = std::make_unique<CudaRegion>();
  region->name = name;
  region->size = size;
  void* p = nullptr;
  RETURN_IF_ERROR(region->Check(cudaSetDevice(region->device), "cudaSetDevice(0)"));
  RETURN_IF_ERROR(region->Check(cudaMalloc(&p, static_cast<size_t>(size)), "cudaMalloc"));
  region->data = static_cast<char*>(p);
  cudaIpcMemHandle_t handle;
  RETURN_IF_ERROR(region->Check(cudaIpcGetMemHandle(&handle, p), "cudaIpcGetMemHandle"));
  region->handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  return std::unique_ptr<V2Client::Region>(std::move(region));
}
#endif

}  // namespace

V2Client::V2Client(AttentionClient* client, V2Shm shm) : client_(client), shm_(shm) {
  for (int i = 0; i < client->num_channels(); ++i) {
    stubs_.push_back(inference::GRPCInferenceService::NewStub(client->channel(i)));
  }
}

inference::GRPCInferenceService::Stub& V2Client::Stub() {
  return *stubs_[next_.fetch_add(1, std::memory_order_relaxed) % stubs_.size()];
}

absl::Status V2Client::Register(Region* region) {
  grpc::ClientContext ctx;
  client_->Prepare(CallOptions(), &ctx);
  grpc::Status st;
  if (shm_ == V2Shm::kSystem) {
    inference::SystemSharedMemoryRegisterRequest request;
    request.set_name(region->name);
    request.set_key(static_cast<SystemRegion*>(region)->key);
    request.set_byte_size(static_cast<uint64_t>(region->size));
    inference::SystemSharedMemoryRegisterResponse response;
    st = Stub().SystemSharedMemoryRegister(&ctx, request, &response);
  } else {
#if ATTNSERVE_HAVE_CUDA
    auto* cuda = static_cast<CudaRegion*>(region);
    inference::CudaSharedMemoryRegisterRequest request;
    request.set_name(region->name);
    request.set_raw_handle(cuda->handle);
    request.set_device_id(cuda->device);
    request.set_byte_size(static_cast<uint64_t>(region->size));
    inference::CudaSharedMemoryRegisterResponse response;
    st = Stub().CudaSharedMemoryRegister(&ctx, request, &response);
#endif
  }
  if (st.ok()) return absl::OkStatus();
  const absl::Status status = ToAbslStatus(st);
  return absl::Status(
      status.code(),
      absl::StrCat("--shm=", V2ShmName(shm_), ": registering region '", region->name,
                   "': ", status.message(), " (does the server run with --allow_client_shm?)"));
}

absl::StatusOr<std::unique_ptr<V2Client>> V2Client::Create(AttentionClient* client, V2Shm shm,
                                                           int slots, int64_t slot_bytes,
                                                           const std::string& key_prefix) {
#if !ATTNSERVE_HAVE_CUDA
  if (shm == V2Shm::kCuda) {
    return absl::FailedPreconditionError(
        "--shm=cuda: this attnctl was built without CUDA (-DATTNSERVE_CUDA=OFF); use "
        "--shm=system, or a CUDA build");
  }
#endif
  std::unique_ptr<V2Client> v2(new V2Client(client, shm));
  for (int s = 0; shm != V2Shm::kNone && s < slots; ++s) {
    const std::string name = absl::StrCat("attnctl_", getpid(), "_", s);
    const int64_t size = std::max<int64_t>(slot_bytes, 1);
#if ATTNSERVE_HAVE_CUDA
    absl::StatusOr<std::unique_ptr<Region>> region =
        shm == V2Shm::kCuda ? MakeCudaRegion(name, size) : MakeSystemRegion(key_prefix, name, size);
#else
    absl::StatusOr<std::unique_ptr<Region>> region = MakeSystemRegion(key_prefix, name, size);
#endif
    if (!region.ok()) return region.status();
    v2->regions_.push_back(*std::move(region));
    RETURN_IF_ERROR(v2->Register(v2->regions_.back().get()));
    v2->registered_ = s + 1;
  }
  return v2;
}

V2Client::~V2Client() {
  for (int i = 0; i < registered_; ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    const std::string& name = regions_[static_cast<size_t>(i)]->name;
    // Best effort: the server drops a client's regions only when told.
    if (shm_ == V2Shm::kSystem) {
      inference::SystemSharedMemoryUnregisterRequest request;
      request.set_name(name);
      inference::SystemSharedMemoryUnregisterResponse response;
      Stub().SystemSharedMemoryUnregister(&ctx, request, &response);
    } else {
      inference::CudaSharedMemoryUnregisterRequest request;
      request.set_name(name);
      inference::CudaSharedMemoryUnregisterResponse response;
      Stub().CudaSharedMemoryUnregister(&ctx, request, &response);
    }
  }
}

absl::StatusOr<v1::ForwardResponse> V2Client::Forward(const v1::ForwardRequest& request, int slot) {
  if (regions_.empty()) return Infer(ToModelInferRequest(request));
  return InferThroughRegion(request, /*input=*/-1, /*read_outputs=*/true, RegionFor(slot));
}

absl::StatusOr<v1::ForwardResponse> V2Client::ForwardStaged(const v1::ForwardRequest& request,
                                                            int input, int slot,
                                                            bool read_outputs) {
  if (regions_.empty()) {
    return absl::FailedPreconditionError("ForwardStaged: the client has no shared memory");
  }
  return InferThroughRegion(request, input, read_outputs, RegionFor(slot));
}

V2Client::Region* V2Client::RegionFor(int slot) const {
  return regions_[static_cast<size_t>(slot) % regions_.size()].get();
}

absl::StatusOr<v1::ForwardResponse> V2Client::Infer(const inference::ModelInferRequest& request) {
  grpc::ClientContext ctx;
  client_->Prepare(CallOptions(), &ctx);
  inference::ModelInferResponse response;
  const grpc::Status st = Stub().ModelInfer(&ctx, request, &response);
  if (!st.ok()) return ToAbslStatus(st);
  return FromModelInferResponse(std::move(response));
}

absl::StatusOr<v1::ForwardResponse> V2Client::InferThroughRegion(const v1::ForwardRequest& request,
                                                                 int input, bool read_outputs,
                                                                 Region* region) {
  if (V2SlotBytes(request) > region->size) {
    return absl::InvalidArgumentError(absl::StrCat("--shm: the request needs ",
                                                   V2SlotBytes(request), " bytes, the region has ",
                                                   region->size));
  }
  // Inputs, then o and lse, packed from the start of the region.
  inference::ModelInferRequest v2;
  v2.set_model_name(kV2AttentionModel);
  v2.set_id(request.request_id());
  int64_t offset = 0;
  const bool write_inputs = input < 0 || region->staged_input != input;
  region->staged_input = -1;  // until every input is written
  auto place = [&](google::protobuf::Map<std::string, inference::InferParameter>* p,
                   int64_t bytes) {
    (*p)["shared_memory_region"].set_string_param(region->name);
    (*p)["shared_memory_offset"].set_int64_param(offset);
    (*p)["shared_memory_byte_size"].set_int64_param(bytes);
    offset += bytes;
  };
  for (const V2Input& in : InputsOf(request)) {
    auto* t = v2.add_inputs();
    t->set_name(in.name);
    t->set_datatype(in.datatype);
    for (int64_t d : in.shape) t->add_shape(d);
    if (write_inputs) RETURN_IF_ERROR(region->Write(offset, in.bytes));
    place(t->mutable_parameters(), static_cast<int64_t>(in.bytes.size()));
  }
  if (input >= 0) region->staged_input = input;
  SetParameters(request.options(), &v2);
  auto* o = v2.add_outputs();
  o->set_name("o");
  place(o->mutable_parameters(), OBytes(request));
  if (request.options().return_lse()) {
    auto* lse = v2.add_outputs();
    lse->set_name("lse");
    place(lse->mutable_parameters(), LseBytes(request.q()));
  }
  grpc::ClientContext ctx;
  client_->Prepare(CallOptions(), &ctx);
  inference::ModelInferResponse response;
  const grpc::Status st = Stub().ModelInfer(&ctx, v2, &response);
  if (!st.ok()) return ToAbslStatus(st);
  // The outputs are in the region, where the request placed them.
  for (int i = 0; i < response.outputs_size(); ++i) {
    const auto& out = response.outputs(i);
    for (const auto& requested : v2.outputs()) {
      if (requested.name() != out.name()) continue;
      const int64_t at = requested.parameters().at("shared_memory_offset").int64_param();
      const int64_t room = requested.parameters().at("shared_memory_byte_size").int64_param();
      const int64_t bytes = BytesOf(out);
      if (bytes < 0 || bytes > room) {
        return absl::InternalError(absl::StrCat("outputs['", out.name(), "']: ", bytes,
                                                " bytes do not fit the ", room, " placed"));
      }
      while (response.raw_output_contents_size() <= i) response.add_raw_output_contents();
      if (read_outputs) {
        RETURN_IF_ERROR(region->Read(at, bytes, response.mutable_raw_output_contents(i)));
      }
    }
  }
  return FromModelInferResponse(std::move(response));
}

void V2Client::InferAsync(const inference::ModelInferRequest& request,
                          std::function<void(absl::StatusOr<v1::ForwardResponse>)> done) {
  inference::GRPCInferenceService::Stub* stub = &Stub();
  StartAsyncUnary<inference::ModelInferRequest, inference::ModelInferResponse>(
      request, [this](grpc::ClientContext* ctx) { client_->Prepare(CallOptions(), ctx); },
      [stub](auto* ctx, auto* req, auto* resp, auto reaction) {
        stub->async()->ModelInfer(ctx, req, resp, std::move(reaction));
      },
      [done = std::move(done)](absl::StatusOr<inference::ModelInferResponse> r) {
        if (!r.ok()) return done(r.status());
        done(FromModelInferResponse(*std::move(r)));
      });
}

}  // namespace attnserve
