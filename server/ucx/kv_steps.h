// The K/V service behind the UCX listener (docs/ucx.md): a hello's bearer
// token becomes the connection's tenant exactly as a gRPC call's does, and a
// step frame becomes the same KvCall the gRPC AppendAttend runs (KvRunner:
// draining, the tenant's in-flight quota, the cache lookup, validation, the
// pool), its tensors viewing the payload buffers the listener received them
// into. The reply is AppendAttendResponse's header with O and LSE as payloads;
// a refused step answers error_code and error_message as the stream form does.
#pragma once

#include <memory>
#include <string>

#include "attnserve/v1/kv.pb.h"
#include "server/auth/authenticator.h"
#include "server/core/kv_runner.h"
#include "server/ucx/listener.h"

namespace attnserve {
namespace ucx {

// The step's AppendAttendRequest from its header bytes, checked for what the
// UCX form refuses: tensor bytes in the header (they come as payloads) and
// shared-memory spans. INVALID_ARGUMENT naming the field.
absl::StatusOr<v1::AppendAttendRequest> ParseStepHeader(absl::string_view header);

// The reply frame for `response` and its payloads (taken from o and lse,
// whose data is cleared).
Reply EncodeReply(FrameType type, v1::AppendAttendResponse* response);

class KvSteps final : public StepHandler {
 public:
  // `runner` and `auth` (null: authentication off) must outlive the listener.
  KvSteps(KvRunner* runner, const Authenticator* auth) : runner_(runner), auth_(auth) {}

  absl::StatusOr<std::shared_ptr<const Session>> Hello(absl::string_view authorization) override;
  void Step(std::shared_ptr<const Session> session, std::shared_ptr<StepFrame> frame,
            std::function<void(Reply)> done) override;
  Reply StatusReply(FrameType type, const absl::Status& status,
                    absl::string_view request_id) override;

 private:
  KvRunner* const runner_;
  const Authenticator* const auth_;
};

}  // namespace ucx
}  // namespace attnserve
