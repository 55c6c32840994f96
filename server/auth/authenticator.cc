// Bearer-token authentication; see authenticator.h.
#include "server/auth/authenticator.h"

#include <openssl/crypto.h>

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "spdlog/spdlog.h"

namespace attnserve {

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::Create(const AuthOptions& options,
                                                                     TenantDirectory* tenants) {
  absl::StatusOr<TokenTable> table = LoadTokenFile(options.tokens_file);
  if (!table.ok()) return table.status();
  if (table->tokens.empty()) {
    return absl::InvalidArgumentError("tokens file '" + options.tokens_file +
                                      "': expected at least one token, got none");
  }
  if (options.reload_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("auth reload interval: expected > 0, got " +
                                      absl::FormatDuration(options.reload_interval));
  }
  return std::unique_ptr<Authenticator>(new Authenticator(options, tenants, *std::move(table)));
}

Authenticator::Authenticator(const AuthOptions& options, TenantDirectory* tenants, TokenTable table)
    : options_(options), tenants_(tenants) {
  tenants_->SetQuotas(table.quotas);
  spdlog::info("auth: {} bearer token(s) for {} tenant(s) from {}", table.tokens.size(),
               table.quotas.size(), options_.tokens_file);
  table_ = std::make_shared<const TokenTable>(std::move(table));
  watcher_ = std::make_unique<FileWatcher>(std::vector<std::string>{options_.tokens_file},
                                           options_.reload_interval, [this] { Reload(); });
}

void Authenticator::Reload() {
  absl::StatusOr<TokenTable> table = LoadTokenFile(options_.tokens_file);
  if (!table.ok() || table->tokens.empty()) {
    spdlog::error("auth: keeping the previous tokens: {}",
                  table.ok() ? std::string("the new file has no token")
                             : std::string(table.status().message()));
    return;
  }
  tenants_->SetQuotas(table->quotas);
  const size_t tokens = table->tokens.size();
  const size_t tenant_count = table->quotas.size();
  {
    absl::MutexLock lock(&mu_);
    table_ = std::make_shared<const TokenTable>(*std::move(table));
  }
  reloads_.fetch_add(1, std::memory_order_acq_rel);
  spdlog::info("auth: reloaded {} bearer token(s) for {} tenant(s) from {}", tokens, tenant_count,
               options_.tokens_file);
}

namespace {

// The one place the header is taken apart; the message never quotes it.
absl::StatusOr<absl::string_view> TokenOfHeader(absl::string_view authorization) {
  absl::string_view token = absl::StripAsciiWhitespace(authorization);
  constexpr absl::string_view kScheme = "bearer ";
  if (token.empty() || token.size() <= kScheme.size() ||
      !absl::EqualsIgnoreCase(token.substr(0, kScheme.size()), kScheme)) {
    return absl::UnauthenticatedError(
        "expected an 'authorization: Bearer <token>' header (attnctl --token or ATTNSERVE_TOKEN)");
  }
  return absl::StripLeadingAsciiWhitespace(token.substr(kScheme.size()));
}

// The entry of `digest`, comparing every entry whatever matched: the time
// taken depends on the number of tokens only.
const TokenEntry* FindDigest(const TokenTable& table, const TokenDigest& digest) {
  const TokenEntry* match = nullptr;
  for (const TokenEntry& entry : table.tokens) {
    const bool equal = CRYPTO_memcmp(entry.digest.data(), digest.data(), digest.size()) == 0;
    if (equal) match = &entry;
  }
  return match;
}

}  // namespace

absl::StatusOr<TokenDigest> Authenticator::DigestOfHeader(absl::string_view authorization) {
  absl::StatusOr<absl::string_view> token = TokenOfHeader(authorization);
  if (!token.ok()) return token.status();
  return DigestToken(*token);
}

absl::Status Authenticator::StillValid(const TokenDigest& digest, const std::string& tenant,
                                       std::atomic<int64_t>* generation) const {
  // Read before the table: a reload between the two makes the next request
  // look again rather than trust a table older than the generation it records.
  const int64_t now = reloads_.load(std::memory_order_acquire);
  if (generation->load(std::memory_order_acquire) == now) return absl::OkStatus();
  std::shared_ptr<const TokenTable> table;
  {
    absl::MutexLock lock(&mu_);
    table = table_;
  }
  const TokenEntry* match = FindDigest(*table, digest);
  if (match == nullptr || match->tenant != tenant) {
    return absl::UnauthenticatedError(
        "the stream's bearer token was withdrawn (the tokens file was reloaded): open a new "
        "stream with a current token");
  }
  generation->store(now, std::memory_order_release);
  return absl::OkStatus();
}

absl::StatusOr<std::string> Authenticator::Authenticate(absl::string_view authorization,
                                                        bool count) const {
  absl::StatusOr<absl::string_view> token = TokenOfHeader(authorization);
  if (!token.ok()) {
    if (count) tenants_->RecordUnauthenticated();
    return token.status();
  }
  std::shared_ptr<const TokenTable> table;
  {
    absl::MutexLock lock(&mu_);
    table = table_;
  }
  const TokenEntry* match = FindDigest(*table, DigestToken(*token));
  if (match == nullptr) {
    if (count) tenants_->RecordUnauthenticated();
    return absl::UnauthenticatedError("bearer token not recognised");
  }
  if (count) tenants_->RecordCall(match->tenant);
  return match->tenant;
}

}  // namespace attnserve
