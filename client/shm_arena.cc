// ShmArena: creating, registering and removing the shared memory, and the
// span bookkeeping (see shm_arena.h).
#include "client/shm_arena.h"

#include <fcntl.h>
#include <grpcpp/client_context.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "client/attention_client.h"
#include "client/host_tensor.h"
#include "common/dtype.h"

#if ATTNSERVE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace attnserve {
namespace {

#if ATTNSERVE_HAVE_CUDA
absl::Status CudaStatus(cudaError_t err, absl::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat("shm=cuda: ", what, " failed: ", cudaGetErrorString(err)));
}
#endif

// "arena-<pid>-<n>-<8 hex>": unique among this process's arenas and, by the
// pid and the random part, among other processes'.
std::string DefaultName() {
  static std::atomic<uint64_t> counter{0};
  std::random_device entropy;
  return absl::StrCat("arena-", getpid(), "-", counter.fetch_add(1), "-",
                      absl::Hex(entropy(), absl::kZeroPad8));
}

int64_t ProductOf(const google::protobuf::RepeatedField<int64_t>& shape, int drop_last) {
  int64_t n = 1;
  for (int i = 0; i + drop_last < shape.size(); ++i) n *= shape.Get(i);
  return n;
}

}  // namespace

absl::StatusOr<ShmMode> ParseShmMode(absl::string_view name) {
  if (name == "none" || name.empty()) return ShmMode::kNone;
  if (name == "system") return ShmMode::kSystem;
  if (name == "cuda") return ShmMode::kCuda;
  return absl::InvalidArgumentError(
      absl::StrCat("--shm: expected none, system or cuda, got '", name, "'"));
}

const char* ShmModeName(ShmMode mode) {
  switch (mode) {
    case ShmMode::kNone: return "none";
    case ShmMode::kSystem: return "system";
    case ShmMode::kCuda: return "cuda";
  }
  return "none";
}

bool ShmCudaAvailable() { return ATTNSERVE_HAVE_CUDA != 0; }

uint64_t ShmOBytes(const v1::Tensor& q, int64_t head_dim_v) {
  absl::StatusOr<DType> dtype = DTypeFromProto(q.dtype());
  if (!dtype.ok()) return 0;
  int64_t elements = ProductOf(q.shape(), 0);
  if (head_dim_v > 0 && q.shape_size() > 0 && q.shape(q.shape_size() - 1) > 0) {
    elements = elements / q.shape(q.shape_size() - 1) * head_dim_v;
  }
  return static_cast<uint64_t>(elements * DTypeSize(OutputDType(*dtype)));
}

uint64_t ShmLseBytes(const v1::Tensor& q) {
  return static_cast<uint64_t>(ProductOf(q.shape(), 1) * int64_t{4});
}

absl::StatusOr<ShmOutputSpans> AllocateOutputSpans(ShmArena& arena, const v1::Tensor& q,
                                                   bool return_lse, v1::OutputRegions* regions,
                                                   int64_t head_dim_v) {
  ShmOutputSpans spans;
  const uint64_t o_bytes = ShmOBytes(q, head_dim_v);
  if (o_bytes == 0) return spans;
  absl::StatusOr<ShmSpan> o = arena.Allocate(o_bytes);
  if (!o.ok()) return o.status();
  spans.has_o = true;
  spans.o = *o;
  *regions->mutable_o() = arena.ToProto(*o);
  if (return_lse) {
    absl::StatusOr<ShmSpan> lse = arena.Allocate(ShmLseBytes(q));
    if (!lse.ok()) return lse.status();
    spans.has_lse = true;
    spans.lse = *lse;
    *regions->mutable_lse() = arena.ToProto(*lse);
  }
  return spans;
}

absl::StatusOr<std::unique_ptr<ShmArena>> ShmArena::Create(AttentionClient& client,
                                                           const ShmArenaOptions& options) {
  if (options.mode == ShmMode::kNone) {
    return absl::InvalidArgumentError("ShmArenaOptions.mode: expected system or cuda, got none");
  }
  if (options.byte_size == 0) {
    return absl::InvalidArgumentError("ShmArenaOptions.byte_size: expected > 0, got 0");
  }
  if (options.mode == ShmMode::kCuda && !ShmCudaAvailable()) {
    return absl::FailedPreconditionError(
        "--shm=cuda: this client was built without CUDA (the CUDA runtime was not found when "
        "it was configured); use --shm=system, or a CUDA build");
  }
  std::unique_ptr<ShmArena> arena(new ShmArena());
  arena->mode_ = options.mode;
  arena->name_ = options.name.empty() ? DefaultName() : options.name;
  arena->size_ = options.byte_size;
  arena->cuda_device_ = options.cuda_device;
  const char* const flag = options.mode == ShmMode::kCuda ? "--shm=cuda" : "--shm=system";

  if (options.mode == ShmMode::kSystem) {
    const std::string& prefix = options.key_prefix;
    if (prefix.empty() || prefix[0] != '/' || prefix.find('/', 1) != std::string::npos ||
        arena->name_.find('/') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shared-memory key prefix: expected \"/\" and no other \"/\" (e.g. \"",
          kDefaultShmKeyPrefix, "\"), got \"", prefix, "\" with name \"", arena->name_, "\""));
    }
    arena->key_ = prefix + arena->name_;
    const int fd = shm_open(arena->key_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
      const int error = errno;
      return absl::Status(
          error == EEXIST ? absl::StatusCode::kAlreadyExists : absl::StatusCode::kInternal,
          absl::StrCat(flag, ": shm_open(\"", arena->key_, "\"): ", std::strerror(error)));
    }
    arena->linked_ = true;
    void* p = MAP_FAILED;
    if (ftruncate(fd, static_cast<off_t>(arena->size_)) == 0) {
      p = mmap(nullptr, arena->size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    }
    const int error = errno;
    close(fd);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat(flag, ": cannot map ", arena->size_,
                                                       " bytes of \"", arena->key_,
                                                       "\": ", std::strerror(error)));
    }
    arena->host_ = static_cast<char*>(p);
  } else {
#if ATTNSERVE_HAVE_CUDA
    void* p = nullptr;
    absl::Status st = CudaStatus(cudaSetDevice(arena->cuda_device_),
                                 absl::StrCat("cudaSetDevice(", arena->cuda_device_, ")"));
    if (!st.ok()) return st;
    st = CudaStatus(cudaMalloc(&p, arena->size_), absl::StrCat("cudaMalloc(", arena->size_, ")"));
    if (!st.ok()) return st;
    arena->device_ = p;
    cudaIpcMemHandle_t handle;
    st = CudaStatus(cudaIpcGetMemHandle(&handle, p), "cudaIpcGetMemHandle");
    if (!st.ok()) return st;
    arena->cuda_handle_.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
#endif
  }
  const absl::Status registered = arena->Register(client);
  if (!registered.ok()) return registered;
  if (options.unlink_after_register && arena->linked_) {
    shm_unlink(arena->key_.c_str());
    arena->linked_ = false;
  }
  return arena;
}

absl::Status ShmArena::Register(AttentionClient& client) {
  client_ = &client;
  stub_ = v1::SharedMemory::NewStub(client.channel(0));
  v1::RegisterRegionRequest request;
  request.set_name(name_);
  request.set_byte_size(size_);
  if (mode_ == ShmMode::kSystem) {
    request.mutable_system()->set_key(key_);
    request.mutable_system()->set_offset(0);
  } else {
    request.mutable_cuda()->set_raw_handle(cuda_handle_);
    request.mutable_cuda()->set_device_id(cuda_device_);
  }
  grpc::ClientContext context;
  client.Prepare(CallOptions(), &context);
  v1::RegisterRegionResponse response;
  const absl::Status status = ToAbslStatus(stub_->Register(&context, request, &response));
  if (status.ok()) {
    registered_ = true;
    return status;
  }
  std::string hint;
  // A server that says the flag itself (every attnserve does) needs no hint.
  if (status.code() == absl::StatusCode::kFailedPrecondition &&
      !absl::StrContains(status.message(), "--allow_client_shm")) {
    hint = " (the server must run with --allow_client_shm)";
  } else if (status.code() == absl::StatusCode::kUnimplemented) {
    hint = " (this server has no attnserve.v1.SharedMemory service)";
  } else if (status.code() == absl::StatusCode::kPermissionDenied) {
    hint = " (with tokens, keys must start with \"/attnserve.<tenant>.\": see --shm_prefix)";
  }
  return absl::Status(status.code(),
                      absl::StrCat("--shm=", ShmModeName(mode_), ": registering region '", name_,
                                   "': ", status.message(), hint));
}

ShmArena::~ShmArena() { Close().IgnoreError(); }

absl::Status ShmArena::Close() {
  absl::Status status;
  if (registered_) {
    registered_ = false;
    v1::UnregisterRegionRequest request;
    request.set_name(name_);
    v1::UnregisterRegionResponse response;
    grpc::ClientContext context;
    CallOptions call;
    call.timeout = absl::Seconds(5);
    client_->Prepare(call, &context);
    status = ToAbslStatus(stub_->Unregister(&context, request, &response));
    if (!status.ok()) {
      status = absl::Status(status.code(),
                            absl::StrCat("unregistering region '", name_, "': ", status.message()));
    }
  }
  if (host_ != nullptr) {
    munmap(host_, size_);
    host_ = nullptr;
  }
  if (linked_) {
    shm_unlink(key_.c_str());
    linked_ = false;
  }
#if ATTNSERVE_HAVE_CUDA
  if (device_ != nullptr) {
    cudaSetDevice(cuda_device_);
    cudaFree(device_);
  }
#endif
  device_ = nullptr;
  return status;
}

absl::StatusOr<ShmSpan> ShmArena::Allocate(uint64_t bytes) {
  const uint64_t start = (used_ + kShmAlignment - 1) / kShmAlignment * kShmAlignment;
  if (start > size_ || bytes > size_ - start) {
    return absl::ResourceExhaustedError(absl::StrCat("shared-memory region '", name_, "': ", bytes,
                                                     " bytes at offset ", start, " do not fit its ",
                                                     size_, " bytes"));
  }
  used_ = start + bytes;
  return ShmSpan{start, bytes};
}

absl::Status ShmArena::Write(const ShmSpan& span, absl::string_view bytes) {
  if (bytes.size() != span.size || span.offset > size_ || span.size > size_ - span.offset) {
    return absl::InvalidArgumentError(absl::StrCat("Write: ", bytes.size(), " bytes into a span [",
                                                   span.offset, ", +", span.size, ") of ", size_));
  }
  if (bytes.empty()) return absl::OkStatus();
  if (host_ != nullptr) {
    std::memcpy(host_ + span.offset, bytes.data(), bytes.size());
    return absl::OkStatus();
  }
#if ATTNSERVE_HAVE_CUDA
  return CudaStatus(cudaMemcpy(static_cast<char*>(device_) + span.offset, bytes.data(),
                               bytes.size(), cudaMemcpyHostToDevice),
                    "cudaMemcpy into the region");
#else
  return absl::FailedPreconditionError("the arena is closed");
#endif
}

absl::Status ShmArena::Read(const ShmSpan& span, std::string* out) const {
  if (span.offset > size_ || span.size > size_ - span.offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("Read: span [", span.offset, ", +", span.size, ") of ", size_));
  }
  if (host_ != nullptr) {
    out->assign(host_ + span.offset, span.size);
    return absl::OkStatus();
  }
#if ATTNSERVE_HAVE_CUDA
  out->resize(span.size);
  if (span.size == 0) return absl::OkStatus();
  return CudaStatus(cudaMemcpy(out->data(), static_cast<const char*>(device_) + span.offset,
                               span.size, cudaMemcpyDeviceToHost),
                    "cudaMemcpy from the region");
#else
  return absl::FailedPreconditionError("the arena is closed");
#endif
}

v1::SharedTensor ShmArena::ToProto(const ShmSpan& span) const {
  v1::SharedTensor t;
  t.set_region(name_);
  t.set_offset(span.offset);
  t.set_byte_size(span.size);
  return t;
}

absl::Status ShmArena::MoveIn(v1::Tensor* tensor) {
  if (tensor->data().empty()) return absl::OkStatus();
  absl::StatusOr<ShmSpan> span = Allocate(tensor->data().size());
  if (!span.ok()) return span.status();
  const absl::Status written = Write(*span, tensor->data());
  if (!written.ok()) return written;
  tensor->clear_data();
  *tensor->mutable_shm() = ToProto(*span);
  return absl::OkStatus();
}

absl::Status ShmArena::TakeOut(const ShmSpan& placed, absl::string_view what,
                               v1::Tensor* tensor) const {
  const v1::SharedTensor& got = tensor->shm();
  if (!tensor->has_shm() || !tensor->data().empty() || got.region() != name_ ||
      got.offset() != placed.offset || got.byte_size() != placed.size) {
    return absl::InternalError(
        absl::StrCat("response ", what, ": expected the span the request named (region '", name_,
                     "', offset ", placed.offset, ", ", placed.size, " bytes), got ",
                     tensor->has_shm() ? absl::StrCat("region '", got.region(), "', offset ",
                                                      got.offset(), ", ", got.byte_size(), " bytes")
                                       : std::string("no span"),
                     " and ", tensor->data().size(), " bytes in the message"));
  }
  const absl::Status read = Read(placed, tensor->mutable_data());
  if (!read.ok()) return read;
  tensor->clear_shm();
  return absl::OkStatus();
}

}  // namespace attnserve
