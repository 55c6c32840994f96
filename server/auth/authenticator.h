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

  // Times the file has been re-read successfully since start (tests wait on
  // it); it is also the generation StillValid compares.
  int64_t reloads() const { return reloads_.load(std::memory_order_acquire); }

  // The digest of the token in `authorization`, or UNAUTHENTICATED as
  // Authenticate says (nothing counted): what a stream keeps to re-check.
  static absl::StatusOr<TokenDigest> DigestOfHeader(absl::string_view authorization);

  // For a stream opened with the token of `digest` for `tenant`: OK while
  // that token still maps to `tenant`, UNAUTHENTICATED once a reloaded file
  // withdrew it or moved it to another tenant. `*generation` is the reload
  // it was last found valid in (start from reloads() before the first
  // lookup); while no reload happened since, this is one atomic load.
  absl::Status StillValid(const TokenDigest& digest, const std::string& tenant,
                          std::atomic<int64_t>* generation) const;

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
