// The client side of the UCX step transport (docs/ucx.md): AppendAttend
// steps whose q/k/v go to the server and whose O (and LSE) come back over a
// UCX stream endpoint (TCP, shared memory or RDMA verbs, as UCX_TLS allows)
// instead of gRPC messages. gRPC stays the control plane: caches and
// sequences are created, dropped and inspected with KvClient, and
// GetServerInfo says whether and where the server takes steps over UCX
// (KvInfo.ucx_port).
//
//   UcxOffer offer = AskUcxOffer(*client);            // GetServerInfo
//   if (offer.port > 0) {
//     auto ucx = UcxStepConnection::Connect(offer.host, offer.port, authorization);
//     absl::StatusOr<AppendAttendResult> out = (*ucx)->AppendAttend(step);
//   }                                                  // else: KvClient::AppendAttend
//
// A connection carries one call at a time and belongs to one thread (UCX is
// used single-threaded: the calling thread progresses the connection's own
// worker); a decode loop gives each group its own.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "attnserve/v1/kv.pb.h"
#include "client/attention_client.h"
#include "client/kv_client.h"

namespace attnserve {

// What carries step tensors: --transport=grpc|ucx|auto.
enum class StepTransport { kGrpc, kUcx, kAuto };
absl::StatusOr<StepTransport> ParseStepTransport(absl::string_view text);

// Whether this client library was built with UCX (cmake/ucx.cmake).
bool UcxBuilt();

// Where a server takes UCX steps: port > 0, or why not (a server without
// --ucx_port, a client built without UCX, a target with no host).
struct UcxOffer {
  std::string host;
  int port = 0;
  std::string why_not;
};
// Asks GetServerInfo; the host is the gRPC target's.
UcxOffer AskUcxOffer(AttentionClient& client);
// The host of a gRPC target ("h:p", "dns:///h:p", "ipv4:h:p", "ipv6:[h]:p");
// empty for unix: targets.
std::string HostOfTarget(const std::string& target);
// "Bearer <token>" for the client's bearer token, or empty.
std::string AuthorizationOf(const AttentionClient& client);

class UcxStepConnection {
 public:
  // Connects and says hello with `authorization` ("Bearer <token>", or empty
  // when the server has no tokens). A refused hello is its status
  // (UNAUTHENTICATED); a server that cannot be reached, UNAVAILABLE.
  static absl::StatusOr<std::unique_ptr<UcxStepConnection>> Connect(
      const std::string& host, int port, const std::string& authorization,
      absl::Duration timeout = absl::Seconds(30));
  ~UcxStepConnection();
  UcxStepConnection(const UcxStepConnection&) = delete;
  UcxStepConnection& operator=(const UcxStepConnection&) = delete;

  // One step. `request`'s q, k and v bytes are sent from where they lie
  // (moved out and back in; nothing is copied), the rest of it as the
  // header. The response carries O and LSE in its tensors, as gRPC's does;
  // a step the server refused is its status with the gRPC call's code and
  // message. A transport failure or timeout is UNAVAILABLE or
  // DEADLINE_EXCEEDED and leaves the connection broken().
  absl::StatusOr<v1::AppendAttendResponse> AppendAttend(
      v1::AppendAttendRequest* request, absl::Duration timeout = absl::Seconds(120));
  // The typed call: builds the request and checks the response's shapes.
  absl::StatusOr<AppendAttendResult> AppendAttend(const AppendAttendInputs& inputs,
                                                  absl::Duration timeout = absl::Seconds(120));

  // For tests of the server's framing: sends `bytes` as they are and reads
  // one reply frame (its header; payloads read and dropped).
  absl::StatusOr<v1::AppendAttendResponse> SendRawAndRead(const std::string& bytes,
                                                          absl::Duration timeout);

  bool broken() const;

  // Steps whose q, k and v come to at least `bytes` send them, and get O and
  // LSE back, as UCX tagged messages (rendezvous for large ones: one transfer
  // straight between the buffers where the transport allows) instead of on
  // the stream, when the server takes them (its hello reply says so); < 0:
  // never. Default: ATTNSERVE_UCX_TAGGED_BYTES, else never.
  void set_tagged_bytes(int64_t bytes);
  // Steps sent tagged so far.
  int64_t tagged_steps() const;

  class Impl;

 private:
  explicit UcxStepConnection(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace attnserve
