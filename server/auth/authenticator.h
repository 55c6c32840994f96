// The authentication seam: turns a call's `authorization` header (gRPC
// metadata or HTTP header) into the tenant it acts for, or UNAUTHENTICATED.
// The one built-in method is bearer tokens from a file (token_file.h); the
// file is re-read when it changes (a log line says so), and a file that fails
// to parse leaves the previous tokens in force. Tokens are compared in
// constant time: the SHA-256 of the presented token against every entry's,
// with CRYPTO_memcmp and no early exit, so neither timing nor length tells an
// attacker how close a guess was.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/auth/tenants.h"
#include "server/auth/token_file.h"
#include "server/security/file_watch.h"

namespace attnserve {

struct AuthOptions {
  std::string tokens_file;  // empty: authentication off, every call is the tenant "default"
  absl::Duration reload_interval = absl::Seconds(10);  // how often the file is checked
};

class Authenticator {
 public:
  // Loads the tokens file (its errors are returned: the server must not start
  // with a broken one) and pushes its quotas to `tenants`, which must outlive
  // the authenticator.
  static absl::StatusOr<std::unique_ptr<Authenticator>> Create(const AuthOptions& options,
                                                               TenantDirectory* tenants);

  // `authorization`: "Bearer <token>" (the scheme case-insensitive). The
  // tenant's name, or UNAUTHENTICATED saying what was missing (never which
  // part of a token was wrong). Counts the call per tenant, or as refused.
  // `count` false: look the token up without counting (a second look at a
  // call already counted).
  absl::StatusOr<std::string> Authenticate(absl::string_view authorization,
                                           bool count = true) const;

  // Times the file has been re-read successfully since start (tests wait on it).
  int64_t reloads() const { return reloads_.load(std::memory_order_acquire); }

 private:
  Authenticator(const AuthOptions& options, TenantDirectory* tenants, TokenTable table);
  void Reload();

  const AuthOptions options_;
  TenantDirectory* const tenants_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const TokenTable> table_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> reloads_{0};
  std::unique_ptr<FileWatcher> watcher_;  // last: stops before the rest goes
};

}  // namespace attnserve
