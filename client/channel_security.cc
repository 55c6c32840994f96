// Client channels with TLS and a bearer token; see channel_security.h.
#include "client/channel_security.h"

#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/client_interceptor.h"

namespace attnserve {
namespace {

absl::StatusOr<std::string> ReadFile(const char* field, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(field, ": cannot read '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Adds the authorization metadata to every call of the channel.
class BearerInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit BearerInterceptor(const std::string* header) : header_(header) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace("authorization", *header_);
    }
    methods->Proceed();
  }

 private:
  const std::string* const header_;
};

class BearerInterceptorFactory final
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerInterceptorFactory(const std::string& token) : header_("Bearer " + token) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new BearerInterceptor(&header_);
  }

 private:
  const std::string header_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeSecureChannel(
    const std::string& target, const ChannelSecurity& security,
    const grpc::ChannelArguments& args) {
  if (security.tls_cert_file.empty() != security.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "tls_cert, tls_key: expected both (mutual TLS) or neither, got one");
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (security.uses_tls()) {
    grpc::SslCredentialsOptions tls;
    if (!security.tls_ca_file.empty()) {
      absl::StatusOr<std::string> roots = ReadFile("tls_ca", security.tls_ca_file);
      if (!roots.ok()) return roots.status();
      tls.pem_root_certs = *std::move(roots);
    }
    if (!security.tls_cert_file.empty()) {
      absl::StatusOr<std::string> cert = ReadFile("tls_cert", security.tls_cert_file);
      if (!cert.ok()) return cert.status();
      absl::StatusOr<std::string> key = ReadFile("tls_key", security.tls_key_file);
      if (!key.ok()) return key.status();
      tls.pem_cert_chain = *std::move(cert);
      tls.pem_private_key = *std::move(key);
    }
    credentials = grpc::SslCredentials(tls);
  }
  std::shared_ptr<grpc::Channel> channel;
  if (security.token.empty()) {
    channel = grpc::CreateCustomChannel(target, credentials, args);
  } else {
    std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> factories;
    factories.push_back(std::make_unique<BearerInterceptorFactory>(security.token));
    channel = grpc::experimental::CreateCustomChannelWithInterceptors(target, credentials, args,
                                                                      std::move(factories));
  }
  if (channel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot create a channel to '", target, "'"));
  }
  return channel;
}

}  // namespace attnserve
