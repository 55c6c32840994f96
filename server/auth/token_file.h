// The bearer-tokens file: one token per line, each mapped to a tenant with
// its quotas (tenants.h). Format (blank lines and `#` comments are skipped):
//
//   <token> <tenant> [bytes_in_flight=N] [kv_pages=N] [shm_regions=N]
//
// A token is 16 to 512 printable, non-space ASCII characters; a tenant name
// 1 to 64 of [A-Za-z0-9._-]. Several tokens may map to one tenant (rotation:
// add the new one, move clients, remove the old one); every line of a tenant
// must then give the same quotas. Errors name the line, never the token.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/auth/tenants.h"

namespace attnserve {

inline constexpr size_t kTokenDigestBytes = 32;  // SHA-256
using TokenDigest = std::array<unsigned char, kTokenDigestBytes>;

struct TokenEntry {
  TokenDigest digest;  // of the token: the file's text is not kept
  std::string tenant;
};

struct TokenTable {
  std::vector<TokenEntry> tokens;
  std::map<std::string, TenantQuotas> quotas;  // per tenant
};

// Parses the file's text; INVALID_ARGUMENT naming the line and what is wrong.
absl::StatusOr<TokenTable> ParseTokenFile(absl::string_view text);
// Reads and parses `path`.
absl::StatusOr<TokenTable> LoadTokenFile(const std::string& path);

TokenDigest DigestToken(absl::string_view token);

}  // namespace attnserve
