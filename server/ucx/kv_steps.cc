// Hello and step frames into the K/V core and back; see kv_steps.h.
#include "server/ucx/kv_steps.h"

#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "server/core/validate.h"
#include "server/native/field_names.h"
#include "server/native/forward_call.h"
#include "server/native/kv_messages.h"
#include "server/tenant.h"

namespace attnserve {
namespace ucx {
namespace {

// A hello's tenant, and the token it came with so each step re-checks it
// (a withdrawn token stops the connection's next step, as on a stream).
class TokenSession final : public Session {
 public:
  TokenSession(const Authenticator* auth, std::string tenant) : auth_(auth), tenant_(tenant) {}
  const std::string& tenant() const override { return tenant_; }
  absl::Status StillValid() const override {
    if (auth_ == nullptr) return absl::OkStatus();
    return auth_->StillValid(digest_, tenant_, &generation_);
  }

  TokenDigest digest_{};
  mutable std::atomic<int64_t> generation_{0};

 private:
  const Authenticator* const auth_;
  const std::string tenant_;
};

absl::Status RefuseInHeader(const v1::Tensor& t, const char* name) {
  if (!t.data().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ".data: expected empty over UCX (the bytes come as payload ", name,
                     "), got ", t.data().size(), " bytes"));
  }
  if (t.has_shm()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ".shm: expected unset over UCX (the bytes come as payload ", name, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::AppendAttendRequest> ParseStepHeader(absl::string_view header) {
  v1::AppendAttendRequest request;
  if (!request.ParseFromArray(header.data(), static_cast<int>(header.size()))) {
    return absl::InvalidArgumentError(
        absl::StrCat("header: expected a serialized AppendAttendRequest, got ", header.size(),
                     " bytes that do not parse as one"));
  }
  for (const auto& [tensor, name] : {std::pair<const v1::Tensor*, const char*>{&request.q(), "q"},
                                     {&request.k(), "k"},
                                     {&request.v(), "v"}}) {
    if (absl::Status refused = RefuseInHeader(*tensor, name); !refused.ok()) return refused;
  }
  if (request.has_output_shm()) {
    return absl::InvalidArgumentError(
        "output_shm: expected unset over UCX (O and LSE come back as payloads)");
  }
  if (request.k_scale().has_shm() || request.v_scale().has_shm()) {
    return absl::InvalidArgumentError("k_scale.shm, v_scale.shm: expected unset over UCX");
  }
  return request;
}

Reply EncodeReply(FrameType type, v1::AppendAttendResponse* response) {
  Reply reply;
  if (response->has_o()) reply.payloads[kO] = std::move(*response->mutable_o()->mutable_data());
  if (response->has_lse()) {
    reply.payloads[kLse] = std::move(*response->mutable_lse()->mutable_data());
  }
  response->mutable_o()->clear_data();
  if (response->has_lse()) response->mutable_lse()->clear_data();
  if (!response->has_o() || response->o().shape_size() == 0) response->clear_o();
  const std::string header = response->SerializeAsString();
  FramePrefix prefix;
  prefix.type = type;
  prefix.header_bytes = static_cast<uint32_t>(header.size());
  prefix.payload_bytes[kO] = reply.payloads[kO].size();
  prefix.payload_bytes[kLse] = reply.payloads[kLse].size();
  reply.head = EncodePrefix(prefix) + header;
  return reply;
}

absl::StatusOr<std::shared_ptr<const Session>> KvSteps::Hello(absl::string_view authorization) {
  if (auth_ == nullptr) return std::make_shared<TokenSession>(nullptr, kDefaultTenant);
  // Before the lookup: a reload after it makes the first step look again.
  const int64_t generation = auth_->reloads();
  absl::StatusOr<std::string> tenant = auth_->Authenticate(authorization);
  if (!tenant.ok()) return tenant.status();
  absl::StatusOr<TokenDigest> digest = Authenticator::DigestOfHeader(authorization);
  if (!digest.ok()) return digest.status();
  auto session = std::make_shared<TokenSession>(auth_, *tenant);
  session->digest_ = *digest;
  session->generation_.store(generation, std::memory_order_release);
  return session;
}

Reply KvSteps::StatusReply(FrameType type, const absl::Status& status,
                           absl::string_view request_id) {
  v1::AppendAttendResponse response;
  response.set_request_id(std::string(request_id.substr(0, kMaxRequestIdBytes)));
  response.set_backend(runner_->backend_name());
  response.set_error_code(ToRpcCode(status));
  response.set_error_message(std::string(status.message()));
  return EncodeReply(type, &response);
}

namespace {

// What a step keeps alive until its completion has run: the frame (payload
// buffers and budget charge), the parsed header and the call viewing both.
struct StepState {
  std::shared_ptr<StepFrame> frame;
  v1::AppendAttendRequest request;
  KvCall call;
};

}  // namespace

void KvSteps::Step(std::shared_ptr<const Session> session, std::shared_ptr<StepFrame> frame,
                   std::function<void(Reply)> done) {
  absl::StatusOr<v1::AppendAttendRequest> request = ParseStepHeader(frame->header);
  if (!request.ok()) return done(StatusReply(FrameType::kStepReply, request.status(), ""));
  const std::string request_id = request->request_id();
  // A token withdrawn since the hello stops this step.
  if (absl::Status valid = session->StillValid(); !valid.ok()) {
    return done(StatusReply(FrameType::kStepReply, valid, request_id));
  }
  auto state = std::make_shared<StepState>();
  state->frame = std::move(frame);
  state->request = *std::move(request);
  const StepFrame& f = *state->frame;
  state->call =
      KvCallOf(state->request, CallMetaOf(session->tenant(), absl::InfiniteFuture(), f.cancelled));
  KvCall& call = state->call;
  // The tensors view the payload buffers; a tensor is absent only when it
  // has neither shape nor bytes, as in the message form.
  TensorView* views[] = {&call.q, &call.k, &call.v};
  for (int i = 0; i < 3; ++i) {
    views[i]->bytes = f.payload(i);
    views[i]->absent = views[i]->shape.empty() && views[i]->bytes.empty();
  }
  // What --max_request_bytes and the tenant's bytes_in_flight bound: the
  // whole frame, as the message is for gRPC.
  call.request_bytes = static_cast<int64_t>(f.prefix.header_bytes + f.prefix.payload_total());
  runner_->Start(
      &state->call, NativeFieldNames(),
      [this, state, done = std::move(done)](const absl::Status& status, const WorkTimings& timings,
                                            KvResult* result) {
        v1::AppendAttendResponse response;
        response.set_request_id(state->request.request_id().substr(0, kMaxRequestIdBytes));
        response.set_backend(runner_->backend_name());
        if (status.ok()) {
          FillAppendAttendResponse(result, &response);
        } else {
          response.set_error_code(ToRpcCode(status));
          response.set_error_message(std::string(status.message()));
        }
        FillServerTiming(timings, response.mutable_timing());
        Reply reply = EncodeReply(FrameType::kStepReply, &response);
        done(std::move(reply));
      });
}

}  // namespace ucx
}  // namespace attnserve
