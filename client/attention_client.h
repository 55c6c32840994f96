// AttentionClient: the C++ client of the attnserve.v1 Attention service and the
// standard gRPC health service. Every call returns absl::Status(Or); gRPC
// statuses become absl ones through ToAbslStatus (common/grpc_status.h, the
// conversion the server uses the other way).
//
//   auto client = AttentionClient::Create("127.0.0.1:50051");
//   AttentionInputs in;  // q, k, v as HostTensor, optional cu_seqlens, options
//   absl::StatusOr<ForwardResult> out = (*client)->Forward(in);
//
// A client holds one or more channels (ClientOptions::num_channels) and is safe
// to use from many threads at once; calls rotate over the channels.
#pragma once

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/support/status.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "backend/make_params.h"
#include "client/channel_security.h"
#include "client/host_tensor.h"
#include "client/score_mods.h"
#include "client/shm_arena.h"
#include "common/grpc_status.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace attnserve {

// ToAbslStatus (common/grpc_status.h) for a google.rpc.Code carried in a
// message (a stream response's
// error_code): 0 is OK, a code outside google.rpc.Code becomes UNKNOWN.
absl::Status StatusFromRpcCode(int code, const std::string& message);

struct ClientOptions {
  // Deadline of a call that does not set its own. absl::InfiniteDuration():
  // none. Generous by default because a large CPU request can take seconds.
  absl::Duration default_timeout = absl::Seconds(120);
  // Message limits of the channel. gRPC's default receive limit (4 MiB) is far
  // below a real attention output, so both are raised; -1 means unlimited.
  int max_receive_message_bytes = 1 << 30;
  int max_send_message_bytes = 1 << 30;
  // gRPC load-balancing policy: "" keeps gRPC's default (pick_first);
  // "round_robin" spreads calls over every address a dns:/// target resolves to.
  std::string load_balancing_policy;
  // Independent channels (each its own HTTP/2 connection set); calls rotate
  // over them. More than one lets a load generator avoid a single connection's
  // stream limit and head-of-line blocking.
  int num_channels = 1;
  // Wait for the channel to become ready instead of failing fast with
  // UNAVAILABLE while the server is starting.
  bool wait_for_ready = false;
  // TLS, mutual TLS and a bearer token (client/channel_security.h).
  ChannelSecurity security;
};

// Per-call settings; unset fields fall back to ClientOptions.
struct CallOptions {
  std::optional<absl::Duration> timeout;
  std::optional<bool> wait_for_ready;
};

// attnserve.v1.AttentionOptions on the client side: the mask, scale,
// softcap and FP8 descale options (AttnOptions, the ones MakeAttnParams normalises, so the
// verifier reads them exactly as the server does) plus whether to return LSE.
struct ForwardOptions : AttnOptions {
  bool return_lse = false;
};

void AttentionOptionsToProto(const ForwardOptions& from, v1::AttentionOptions* to);

// One attention call. Dense: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] and empty
// cu_seqlens. Varlen: q [Tq, Hq, D], k/v [Tk, Hkv, D] and both cu_seqlens.
struct AttentionInputs {
  HostTensor q;
  HostTensor k;
  HostTensor v;
  std::vector<int32_t> cu_seqlens_q;
  std::vector<int32_t> cu_seqlens_k;
  ForwardOptions options;
  // ALiBi, sinks, bias, element mask and block mask (client/score_mods.h).
  ScoreMods mods;
  std::string request_id;  // optional; echoed by the server
};

// attnserve.v1.ServerTiming of a response, in microseconds.
struct ForwardTiming {
  int64_t queue_us = 0;
  int64_t host_to_device_us = 0;
  int64_t compute_us = 0;
  int64_t device_to_host_us = 0;
  int64_t total_us = 0;
  int batch_size = 1;  // requests that shared the backend launch
};

ForwardTiming ServerTimingFromProto(const v1::ServerTiming& timing);

struct ForwardResult {
  std::string request_id;
  HostTensor o;                   // like q, in q's dtype (BF16 for FP8_E4M3 q)
  std::optional<HostTensor> lse;  // FP32; set only when return_lse was asked for
  ForwardTiming timing;
  std::string backend;  // "cpu" or "cuda"
};

// The wire request for `inputs`. Copies the tensors' bytes; the && overload
// moves them (for callers that build a request once and send it many times,
// build it once and use the raw Forward).
v1::ForwardRequest MakeForwardRequest(const AttentionInputs& inputs);
v1::ForwardRequest MakeForwardRequest(AttentionInputs&& inputs);

// Decodes a response's o and, when `lse` is not null, its lse (Forward's and
// AppendAttend's alike), checking each tensor's dtype and byte length:
// INTERNAL naming the tensor when the server sent a malformed one.
absl::Status OutputsFromProto(v1::Tensor* o, v1::Tensor* lse, HostTensor* out_o,
                              std::optional<HostTensor>* out_lse);

// Decodes a response, checking every tensor's dtype and byte length.
absl::StatusOr<ForwardResult> ForwardResultFromProto(v1::ForwardResponse&& response);

// Same-host shared memory (client/shm_arena.h): resets `arena`, moves
// `request`'s q, k and v into it (Tensor.shm) and asks for O, and LSE with
// return_lse, to be written there (output_shm). RESOURCE_EXHAUSTED when the
// arena is too small (nothing is sent then).
absl::StatusOr<ShmOutputSpans> PlaceForwardInArena(ShmArena& arena, v1::ForwardRequest* request);
// Reads the outputs of a call placed by PlaceForwardInArena back from the
// arena into the response's o and lse, so ForwardResultFromProto decodes it
// like any other. INTERNAL when the response names other spans.
absl::Status TakeForwardOutputs(const ShmArena& arena, const ShmOutputSpans& spans,
                                v1::ForwardResponse* response);

enum class HealthStatus { kUnknown, kServing, kNotServing, kServiceUnknown };
const char* HealthStatusName(HealthStatus status);  // "SERVING", ...

class AttentionClient {
 public:
  // Creates the channels; does not connect (gRPC connects lazily), so a bad
  // host shows up as UNAVAILABLE on the first call. `target` is any gRPC
  // target: "host:port", "dns:///host:port", "unix:///path", "ipv4:a:p,b:p".
  static absl::StatusOr<std::unique_ptr<AttentionClient>> Create(
      const std::string& target, const ClientOptions& options = ClientOptions());

  // Opens every channel's connection now instead of on the first call, so
  // latency measurements do not include connection setup. UNAVAILABLE when a
  // channel fails to connect, DEADLINE_EXCEEDED when `timeout` runs out first.
  absl::Status Connect(absl::Duration timeout);

  // The raw RPC.
  absl::StatusOr<v1::ForwardResponse> Forward(const v1::ForwardRequest& request,
                                              const CallOptions& call = CallOptions());
  // The typed convenience call.
  absl::StatusOr<ForwardResult> Forward(const AttentionInputs& inputs,
                                        const CallOptions& call = CallOptions());
  // Both through `arena` (one call at a time per arena): q, k and v go into
  // it and O (and LSE) come back from it, read into the result's tensors.
  absl::StatusOr<v1::ForwardResponse> Forward(v1::ForwardRequest request, ShmArena& arena,
                                              const CallOptions& call = CallOptions());
  absl::StatusOr<ForwardResult> Forward(const AttentionInputs& inputs, ShmArena& arena,
                                        const CallOptions& call = CallOptions());

  // Non-blocking Forward on gRPC's callback API: `done` runs once, on a gRPC
  // thread, when the call ends. `request` is copied, so it may go away at once.
  void ForwardAsync(const v1::ForwardRequest& request, const CallOptions& call,
                    std::function<void(absl::StatusOr<v1::ForwardResponse>)> done);

  // Echo (attention.proto): the server validates the request exactly like
  // Forward and answers with o = q's bytes (and a zero LSE when asked for)
  // without computing: the transport ceiling for benchmarks. Same overloads
  // as Forward; the typed one checks the shapes the same way.
  absl::StatusOr<v1::ForwardResponse> Echo(const v1::ForwardRequest& request,
                                           const CallOptions& call = CallOptions());
  absl::StatusOr<ForwardResult> Echo(const AttentionInputs& inputs,
                                     const CallOptions& call = CallOptions());
  void EchoAsync(const v1::ForwardRequest& request, const CallOptions& call,
                 std::function<void(absl::StatusOr<v1::ForwardResponse>)> done);

  absl::StatusOr<v1::GetServerInfoResponse> GetServerInfo(const CallOptions& call = CallOptions());

  // grpc.health.v1.Health/Check. "" asks about the server as a whole.
  absl::StatusOr<HealthStatus> HealthCheck(const std::string& service = "",
                                           const CallOptions& call = CallOptions());

  const std::string& target() const { return target_; }
  const ClientOptions& options() const { return options_; }
  int num_channels() const { return static_cast<int>(channels_.size()); }
  // For callers that need the channel itself (connectivity state, own stubs).
  const std::shared_ptr<grpc::Channel>& channel(int i) const { return channels_[i].channel; }
  // Applies the deadline and wait-for-ready of `call` (or of the client's
  // options) to a fresh context; for callers with their own stubs.
  void Prepare(const CallOptions& call, grpc::ClientContext* context) const;

 private:
  struct Channel {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::Attention::Stub> attention;
    std::unique_ptr<grpc::health::v1::Health::Stub> health;
  };

  AttentionClient(std::string target, ClientOptions options);
  // The next channel in rotation.
  Channel& Next();
  // Forward or Echo: the two unary RPCs share a request and response type.
  enum class Unary { kForward, kEcho };
  absl::StatusOr<v1::ForwardResponse> CallUnary(Unary rpc, const v1::ForwardRequest& request,
                                                const CallOptions& call);
  absl::StatusOr<ForwardResult> CallUnaryTyped(Unary rpc, const AttentionInputs& inputs,
                                               const CallOptions& call);
  void CallUnaryAsync(Unary rpc, const v1::ForwardRequest& request, const CallOptions& call,
                      std::function<void(absl::StatusOr<v1::ForwardResponse>)> done);

  std::string target_;
  ClientOptions options_;
  std::vector<Channel> channels_;
  std::atomic<uint64_t> next_{0};
};

}  // namespace attnserve
