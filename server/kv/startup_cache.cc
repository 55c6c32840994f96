// Parses --kv_startup_cache (server/kv/startup_cache.h).
#include "server/kv/startup_cache.h"

#include <limits>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/dtype.h"
#include "common/status_macros.h"

namespace attnserve {
namespace {

absl::Status Bad(absl::string_view cache, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("--kv_startup_cache: cache '", cache, "': ", what));
}

template <typename Int>
absl::Status ParseInt(absl::string_view cache, absl::string_view key, absl::string_view value,
                      Int min, Int* out) {
  int64_t v = 0;
  if (!absl::SimpleAtoi(value, &v) || v < int64_t{min} ||
      v > int64_t{std::numeric_limits<Int>::max()}) {
    return Bad(cache, absl::StrCat(key, ": expected an integer >= ", min, ", got '", value, "'"));
  }
  *out = static_cast<Int>(v);
  return absl::OkStatus();
}

absl::Status ParseKey(absl::string_view cache, absl::string_view key, absl::string_view value,
                      KvStartupCache* out) {
  KvCreateCache& c = out->create;
  if (key == "layers") return ParseInt<int32_t>(cache, key, value, 1, &c.geometry.num_layers);
  if (key == "hkv") return ParseInt<int32_t>(cache, key, value, 1, &c.geometry.num_heads_kv);
  if (key == "d") return ParseInt<int32_t>(cache, key, value, 1, &c.geometry.head_dim);
  // MLA caches: V's head dim, and V inside K (the pool checks the pairing).
  if (key == "dv") return ParseInt<int32_t>(cache, key, value, 1, &c.geometry.head_dim_v);
  if (key == "v_in_k") {
    if (value != "0" && value != "1") {
      return Bad(cache, absl::StrCat("v_in_k: expected 0 or 1, got '", value, "'"));
    }
    c.geometry.v_in_k = value == "1";
    return absl::OkStatus();
  }
  if (key == "page_size") return ParseInt<int32_t>(cache, key, value, 1, &c.page_size);
  if (key == "capacity_tokens") return ParseInt<int64_t>(cache, key, value, 1, &c.capacity_tokens);
  if (key == "capacity_bytes") return ParseInt<int64_t>(cache, key, value, 1, &c.capacity_bytes);
  if (key == "device") {
    int32_t device = 0;
    RETURN_IF_ERROR(ParseInt<int32_t>(cache, key, value, 0, &device));
    c.device = device;
    return absl::OkStatus();
  }
  if (key == "devices") {
    // `all`, or indices joined by '+' (',' separates the keys): 0+1.
    if (value == "all") {
      c.all_devices = true;
      return absl::OkStatus();
    }
    for (absl::string_view part : absl::StrSplit(value, '+')) {
      int32_t device = 0;
      RETURN_IF_ERROR(ParseInt<int32_t>(cache, "devices", part, 0, &device));
      c.devices.push_back(device);
    }
    return absl::OkStatus();
  }
  if (key == "reserve") {
    if (value != "0" && value != "1") {
      return Bad(cache, absl::StrCat("reserve: expected 0 or 1, got '", value, "'"));
    }
    c.reserve = value == "1";
    return absl::OkStatus();
  }
  if (key == "tenant") {
    out->tenant = std::string(value);
    return absl::OkStatus();
  }
  if (key == "dtype") {
    const std::string upper = absl::AsciiStrToUpper(value);
    for (DType t : {DType::kFP16, DType::kBF16, DType::kFP32}) {
      if (upper == DTypeName(t)) {
        c.geometry.dtype = t;
        return absl::OkStatus();
      }
    }
    return Bad(cache, absl::StrCat("dtype: expected FP16, BF16 or FP32, got '", value, "'"));
  }
  if (key == "cache_dtype") {
    // FP8_E4M3: the pages hold codes and scales; the pool checks the pairing.
    const std::string upper = absl::AsciiStrToUpper(value);
    for (DType t : {DType::kFP16, DType::kBF16, DType::kFP32, DType::kFP8E4M3}) {
      if (upper == DTypeName(t)) {
        c.geometry.cache_dtype = t;
        return absl::OkStatus();
      }
    }
    return Bad(cache, absl::StrCat("cache_dtype: expected FP8_E4M3, FP16, BF16 or FP32, got '",
                                   value, "'"));
  }
  return Bad(cache,
             absl::StrCat("unknown key '", key,
                          "' (expected layers, hkv, d, dv, v_in_k, dtype, cache_dtype, page_size, "
                          "capacity_tokens, capacity_bytes, device, devices, reserve or tenant)"));
}

}  // namespace

absl::StatusOr<std::vector<KvStartupCache>> ParseStartupCaches(absl::string_view flag) {
  std::vector<KvStartupCache> caches;
  std::set<std::pair<std::string, std::string>> seen;
  for (absl::string_view spec : absl::StrSplit(flag, ';', absl::SkipWhitespace())) {
    spec = absl::StripAsciiWhitespace(spec);
    const size_t colon = spec.find(':');
    if (colon == absl::string_view::npos || colon == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--kv_startup_cache: expected ID:key=value,... (e.g. "
                       "kv0:layers=1,hkv=8,d=128,dtype=FP16,capacity_tokens=65536), got '",
                       spec, "'"));
    }
    const absl::string_view id = spec.substr(0, colon);
    KvStartupCache cache;
    cache.create.cache_id = std::string(id);
    cache.create.keep = true;
    std::set<std::string> keys;
    for (absl::string_view pair : absl::StrSplit(spec.substr(colon + 1), ',')) {
      const size_t eq = pair.find('=');
      if (eq == absl::string_view::npos) {
        return Bad(id, absl::StrCat("expected key=value, got '", pair, "'"));
      }
      const std::string key(absl::StripAsciiWhitespace(pair.substr(0, eq)));
      if (!keys.insert(key).second) return Bad(id, absl::StrCat("key '", key, "' given twice"));
      RETURN_IF_ERROR(ParseKey(id, key, absl::StripAsciiWhitespace(pair.substr(eq + 1)), &cache));
    }
    for (const char* required : {"layers", "hkv", "d", "dtype"}) {
      if (keys.count(required) == 0) return Bad(id, absl::StrCat("missing key '", required, "'"));
    }
    if ((keys.count("capacity_tokens") > 0) == (keys.count("capacity_bytes") > 0)) {
      return Bad(id, "expected exactly one of capacity_tokens and capacity_bytes");
    }
    if (!seen.insert({cache.tenant, cache.create.cache_id}).second) {
      return Bad(id, "named twice");
    }
    caches.push_back(std::move(cache));
  }
  return caches;
}

}  // namespace attnserve
