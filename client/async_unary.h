// StartAsyncUnary: one unary RPC on gRPC's callback API with its context,
// request and response kept alive on the heap until the reaction runs, shared
// by AttentionClient's and KvClient's *Async methods.
#pragma once

#include <grpcpp/client_context.h>
#include <grpcpp/support/status.h>

#include <functional>
#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "client/attention_client.h"

namespace attnserve {

// `prepare` sets up the context (deadline, metadata); `start` issues the call,
// e.g. [&](auto* ctx, auto* req, auto* resp, auto reaction) {
//   stub.async()->Forward(ctx, req, resp, std::move(reaction)); }.
// `done` runs once, on a gRPC thread, with the response or the call's status.
template <typename Request, typename Response, typename Prepare, typename Start>
void StartAsyncUnary(const Request& request, Prepare prepare, Start start,
                     std::function<void(absl::StatusOr<Response>)> done) {
  struct Pending {
    grpc::ClientContext context;
    Request request;
    Response response;
    std::function<void(absl::StatusOr<Response>)> done;
  };
  auto* pending = new Pending;
  pending->request = request;
  pending->done = std::move(done);
  prepare(&pending->context);
  start(&pending->context, &pending->request, &pending->response, [pending](grpc::Status status) {
    std::unique_ptr<Pending> owned(pending);
    if (status.ok()) {
      owned->done(std::move(owned->response));
    } else {
      owned->done(ToAbslStatus(status));
    }
  });
}

}  // namespace attnserve
