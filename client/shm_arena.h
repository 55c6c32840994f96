// ShmArena: memory a client shares with a server on the same host
// (shm.proto), so a call's tensors leave the gRPC message. The arena creates
// the memory (a POSIX shared-memory object, or device memory exported as a
// CUDA IPC handle), registers it once with SharedMemory.Register, and hands
// out aligned spans that requests name (Tensor.shm for q, k, v;
// OutputRegions for O and LSE). The destructor unregisters the region, then
// unmaps and unlinks the object (or frees the device memory).
//
//   ShmArenaOptions opts;  // system memory, key prefix "/attnserve.default."
//   opts.byte_size = 64 << 20;
//   auto arena = ShmArena::Create(*client, opts);
//   auto out = client->Forward(inputs, **arena);  // q/k/v in, O out, by shm
//
// One arena serves one call at a time: each call starts by Reset(), so a
// caller with calls in flight at once gives each its own arena. The server
// must run with --allow_client_shm; with authentication on, system keys must
// start with "/attnserve.<tenant>." (SECURITY.md) and CUDA regions are
// refused.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attnserve/v1/attention.pb.h"
#include "attnserve/v1/shm.grpc.pb.h"

namespace attnserve {

class AttentionClient;

// How a call's tensors travel: in the message, or through an arena of system
// or CUDA memory. Shared by the native calls and KServe v2 (V2Client).
enum class ShmMode { kNone, kSystem, kCuda };
// "none" (or empty), "system", "cuda"; INVALID_ARGUMENT naming them otherwise.
absl::StatusOr<ShmMode> ParseShmMode(absl::string_view name);
const char* ShmModeName(ShmMode mode);  // "none", "system", "cuda"
// Whether this build can create CUDA arenas (the CUDA runtime was found).
bool ShmCudaAvailable();

// Where system keys go when the caller names no prefix: the key rule's prefix
// for the tenant "default" (every caller when authentication is off).
inline constexpr char kDefaultShmKeyPrefix[] = "/attnserve.default.";
// Spans start on multiples of this (a cache line, and the alignment CUDA
// copies and vector loads like).
inline constexpr uint64_t kShmAlignment = 256;

struct ShmArenaOptions {
  ShmMode mode = ShmMode::kSystem;  // kNone is INVALID_ARGUMENT
  uint64_t byte_size = 0;           // > 0
  // The registered region's name. Empty: "arena-<pid>-<n>-<random hex>",
  // unique on the host.
  std::string name;
  // System: the shm_open name is key_prefix + name. It must start with "/"
  // and hold no other "/"; with tokens, "/attnserve.<tenant>.".
  std::string key_prefix = kDefaultShmKeyPrefix;
  int cuda_device = 0;  // CUDA: the device the memory is allocated on
  // System: remove the object's name as soon as the server has it open (the
  // memory lives on in both mappings), so a process killed before Close
  // leaves nothing in /dev/shm. The region then cannot be registered again
  // (after a server restart, say): make a new arena.
  bool unlink_after_register = false;
};

// A span of an arena: [offset, offset + size).
struct ShmSpan {
  uint64_t offset = 0;
  uint64_t size = 0;
};

// Where a call asked the server to write its outputs (unset: in the message).
struct ShmOutputSpans {
  bool has_o = false;
  ShmSpan o;
  bool has_lse = false;
  ShmSpan lse;
};

class ShmArena {
 public:
  // Creates the memory and registers it through `client`'s channel (with its
  // deadline and token). Errors name the step: INVALID_ARGUMENT for options,
  // ALREADY_EXISTS for a key in use, FAILED_PRECONDITION for a build without
  // CUDA (mode kCuda) or a server without --allow_client_shm (the message
  // says so), the server's code otherwise. Nothing is left behind on error.
  static absl::StatusOr<std::unique_ptr<ShmArena>> Create(AttentionClient& client,
                                                          const ShmArenaOptions& options);
  // Close(), ignoring its status.
  ~ShmArena();
  ShmArena(const ShmArena&) = delete;
  ShmArena& operator=(const ShmArena&) = delete;

  // Unregisters the region (best effort, bounded by 5 s: the server may be
  // gone), then unmaps and unlinks the object or frees the device memory.
  // Returns the unregister call's status; later calls return OK.
  absl::Status Close();

  ShmMode mode() const { return mode_; }
  const std::string& name() const { return name_; }  // as registered
  const std::string& key() const { return key_; }    // system: the shm_open name
  uint64_t size() const { return size_; }
  uint64_t used() const { return used_; }
  // System: the mapping, for callers that produce or consume tensors in
  // place; null for CUDA arenas.
  char* host_data() { return host_; }
  // CUDA: the device pointer; null for system arenas.
  void* device_data() { return device_; }

  // Frees every span (the next call's layout starts at offset 0).
  void Reset() { used_ = 0; }
  // `bytes` more bytes at the next aligned offset; RESOURCE_EXHAUSTED saying
  // how many the arena lacks.
  absl::StatusOr<ShmSpan> Allocate(uint64_t bytes);
  // Copies into / out of the arena (a memcpy, or a CUDA copy).
  absl::Status Write(const ShmSpan& span, absl::string_view bytes);
  absl::Status Read(const ShmSpan& span, std::string* out) const;

  // The wire form of `span`.
  v1::SharedTensor ToProto(const ShmSpan& span) const;
  // Moves a tensor's data into a new span and names the span in its shm (an
  // empty tensor keeps its zero bytes in the message: nothing to share).
  absl::Status MoveIn(v1::Tensor* tensor);
  // Reads an output the server wrote to `placed` back into tensor->data,
  // clearing its shm. INTERNAL naming `what` when the server's answer names
  // another span, or carries bytes in the message instead.
  absl::Status TakeOut(const ShmSpan& placed, absl::string_view what, v1::Tensor* tensor) const;

 private:
  ShmArena() = default;
  absl::Status Register(AttentionClient& client);

  ShmMode mode_ = ShmMode::kNone;
  std::string name_, key_;
  uint64_t size_ = 0, used_ = 0;
  int cuda_device_ = 0;
  char* host_ = nullptr;
  void* device_ = nullptr;
  std::string cuda_handle_;  // the cudaIpcMemHandle_t's bytes
  bool linked_ = false;      // the system object exists and is ours to unlink
  bool registered_ = false;
  std::unique_ptr<v1::SharedMemory::Stub> stub_;
  AttentionClient* client_ = nullptr;
};

// Bytes of an output of `q`: O (OutputDType of q's dtype, q's shape with
// V's head dim `head_dim_v`, 0 meaning q's), and LSE (FP32, one per query row
// and head).
uint64_t ShmOBytes(const v1::Tensor& q, int64_t head_dim_v = 0);
uint64_t ShmLseBytes(const v1::Tensor& q);

// Allocates the spans of q's outputs in `arena` (O, and LSE with `return_lse`)
// and names them in `regions` (a request's output_shm). No query rows: no
// spans, the empty O comes in the message.
// O's head dim is `head_dim_v` (0: q's).
absl::StatusOr<ShmOutputSpans> AllocateOutputSpans(ShmArena& arena, const v1::Tensor& q,
                                                   bool return_lse, v1::OutputRegions* regions,
                                                   int64_t head_dim_v = 0);

}  // namespace attnserve
