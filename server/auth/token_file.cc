// The bearer-tokens file; see token_file.h.
#include "server/auth/token_file.h"

#include <openssl/sha.h>

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace attnserve {
namespace {

constexpr size_t kMinTokenChars = 16;
constexpr size_t kMaxTokenChars = 512;
constexpr size_t kMaxTenantChars = 64;

bool ValidToken(absl::string_view token) {
  if (token.size() < kMinTokenChars || token.size() > kMaxTokenChars) return false;
  for (char c : token) {
    if (c <= ' ' || c > '~') return false;
  }
  return true;
}

bool ValidTenant(absl::string_view name) {
  if (name.empty() || name.size() > kMaxTenantChars) return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

absl::Status ParseQuota(absl::string_view field, TenantQuotas* q) {
  std::pair<absl::string_view, absl::string_view> kv =
      absl::StrSplit(field, absl::MaxSplits('=', 1));
  int64_t value = 0;
  if (!absl::SimpleAtoi(kv.second, &value) || value < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", field, "': expected a quota NAME=N with N >= 0"));
  }
  if (kv.first == "bytes_in_flight") {
    q->bytes_in_flight = value;
  } else if (kv.first == "kv_pages") {
    q->kv_pages = value;
  } else if (kv.first == "shm_regions") {
    q->shm_regions = value;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", kv.first, "': expected a quota of bytes_in_flight, kv_pages or shm_regions"));
  }
  return absl::OkStatus();
}

bool SameQuotas(const TenantQuotas& a, const TenantQuotas& b) {
  return a.bytes_in_flight == b.bytes_in_flight && a.kv_pages == b.kv_pages &&
         a.shm_regions == b.shm_regions;
}

}  // namespace

TokenDigest DigestToken(absl::string_view token) {
  TokenDigest digest;
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), digest.data());
  return digest;
}

absl::StatusOr<TokenTable> ParseTokenFile(absl::string_view text) {
  TokenTable table;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    const std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    auto error = [&](const std::string& what) {
      return absl::InvalidArgumentError(absl::StrCat("tokens file line ", line_number, ": ", what));
    };
    if (fields.size() < 2) return error("expected '<token> <tenant> [quota=N ...]'");
    if (!ValidToken(fields[0])) {
      return error(absl::StrCat("token: expected ", kMinTokenChars, " to ", kMaxTokenChars,
                                " printable non-space ASCII characters, got ", fields[0].size(),
                                " characters"));
    }
    if (!ValidTenant(fields[1])) {
      return error(absl::StrCat("tenant: expected 1 to ", kMaxTenantChars,
                                " characters of [A-Za-z0-9._-], got '", fields[1].substr(0, 80),
                                "'"));
    }
    TenantQuotas quotas;
    for (size_t i = 2; i < fields.size(); ++i) {
      absl::Status s = ParseQuota(fields[i], &quotas);
      if (!s.ok()) return error(std::string(s.message()));
    }
    const std::string tenant(fields[1]);
    auto [it, inserted] = table.quotas.emplace(tenant, quotas);
    if (!inserted && !SameQuotas(it->second, quotas)) {
      return error(absl::StrCat("tenant '", tenant,
                                "': quotas differ from an earlier line of the same tenant"));
    }
    TokenEntry entry{DigestToken(fields[0]), tenant};
    for (const TokenEntry& e : table.tokens) {
      if (e.digest == entry.digest) return error("token: the same token appears twice");
    }
    table.tokens.push_back(std::move(entry));
  }
  return table;
}

absl::StatusOr<TokenTable> LoadTokenFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("tokens file '", path, "': cannot open"));
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<TokenTable> table = ParseTokenFile(text.str());
  if (!table.ok()) {
    return absl::Status(table.status().code(),
                        absl::StrCat("'", path, "': ", table.status().message()));
  }
  return table;
}

}  // namespace attnserve
