// Admission of streaming calls by tenant, decided from a call's metadata
// before the server reads any of its messages: a gRPC server interceptor.
//
// Why here: what a stream holds is counted by its ledger
// (server/stream_flow_control.h) only once a message has been received, and
// each open stream may bring one more message (up to --max_request_bytes)
// beyond any budget. So the number of streams a tenant has open is what
// bounds how far past its budget it can drive the server; it is capped here,
// where the tenant is known (its bearer token) and nothing has been read.
// An admitted stream's ledger charges the tenant's share (its bytes_in_flight
// quota is the share's budget, read when the stream opens); a refused one is
// cancelled before its handler reads anything.
//
// Unary calls are not gated here: gRPC 1.51 receives a unary call's whole
// message before any interceptor or handler sees the call
// (tests/server/unary_admission_test.cc pins it), so the server-wide
// ResourceQuota is their bound (SECURITY.md, "Memory budget").
#pragma once

#include <cstdint>
#include <iterator>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "grpc/grpc.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/server_interceptor.h"
#include "server/auth/authenticator.h"
#include "server/auth/tenants.h"
#include "server/stream_flow_control.h"

namespace attnserve {

class CallAdmissionInterceptor final : public grpc::experimental::Interceptor {
 public:
  // `refusal`: the status message of a call that was not admitted.
  CallAdmissionInterceptor(grpc::experimental::ServerRpcInfo* info, TenantStreamShare* share,
                           bool admitted, std::string refusal)
      : info_(info), share_(share), admitted_(admitted), refusal_(std::move(refusal)) {}
  ~CallAdmissionInterceptor() override {
    if (admitted_) share_->streams.fetch_sub(1, std::memory_order_relaxed);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      if (admitted_) {
        SetOpeningStreamShare(share_);
      } else {
        // RESOURCE_EXHAUSTED with the reason, rather than TryCancel's bare
        // CANCELLED; the handler then sees a cancelled call and reads nothing.
        grpc_call_cancel_with_status(info_->server_context()->c_call(),
                                     GRPC_STATUS_RESOURCE_EXHAUSTED, refusal_.c_str(), nullptr);
      }
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* const info_;
  TenantStreamShare* const share_;
  const bool admitted_;
  const std::string refusal_;
};

class CallAdmission final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  // `auth` null: every call is the tenant "default" (no quota). `tenants`
  // (may be null) gives each tenant's bytes_in_flight quota; `gauge` keeps
  // the shares and must outlive the server. `max_streams_per_tenant` 0: no cap.
  CallAdmission(const Authenticator* auth, TenantDirectory* tenants, StreamGauge* gauge,
                int64_t max_streams_per_tenant)
      : auth_(auth), tenants_(tenants), gauge_(gauge), max_streams_(max_streams_per_tenant) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    using Type = grpc::experimental::ServerRpcInfo::Type;
    // A share set for an earlier call on this thread whose handler built no
    // ledger must not reach a later one.
    SetOpeningStreamShare(nullptr);
    if (info->type() != Type::BIDI_STREAMING && info->type() != Type::CLIENT_STREAMING) {
      return nullptr;  // unary and server-streaming calls pass untouched
    }
    const std::string tenant = TenantOfCall(info->server_context());
    TenantStreamShare* share = gauge_->ShareOf(tenant);
    if (tenants_ != nullptr) {
      share->budget.store(tenants_->QuotasOf(tenant).bytes_in_flight, std::memory_order_relaxed);
    }
    const int64_t open = share->streams.fetch_add(1, std::memory_order_relaxed) + 1;
    const bool admitted = max_streams_ <= 0 || open <= max_streams_;
    std::string refusal;
    if (!admitted) {
      share->streams.fetch_sub(1, std::memory_order_relaxed);
      share->refused.fetch_add(1, std::memory_order_relaxed);
      refusal = absl::StrCat("max_streams_per_tenant: tenant '", tenant, "' has ", open - 1,
                             " streams open, expected at most ", max_streams_,
                             "; close one before opening another");
    }
    return new CallAdmissionInterceptor(info, share, admitted, std::move(refusal));
  }

 private:
  // The tenant of the call's one bearer token (server/tenant.h's rule, over
  // the base context an interceptor sees); calls without exactly one valid
  // token share the withdrawn tenant, which the auth processor has refused.
  std::string TenantOfCall(grpc::ServerContextBase* context) const {
    if (auth_ == nullptr) return "default";
    const auto range = context->client_metadata().equal_range("authorization");
    if (range.first == range.second || std::next(range.first) != range.second) {
      return kWithdrawnTenant;
    }
    absl::StatusOr<std::string> tenant = auth_->Authenticate(
        absl::string_view(range.first->second.data(), range.first->second.size()),
        /*count=*/false);
    return tenant.ok() ? *tenant : std::string(kWithdrawnTenant);
  }

  const Authenticator* const auth_;
  TenantDirectory* const tenants_;
  StreamGauge* const gauge_;
  const int64_t max_streams_;
};

}  // namespace attnserve
