// The metadata header (gRPC) and HTTP header every K/V call should carry with
// its cache id, for proxy affinity (kv.proto); clients send it and both of
// the server's protocols read it. One definition for both sides.
#pragma once

namespace attnserve {

inline constexpr char kCacheIdHeader[] = "x-attnserve-cache-id";

// The trailing metadata of an UNAVAILABLE answer for a cache that moved to
// another replica (kv.proto, --handoff_peer): that replica's address.
inline constexpr char kMovedToHeader[] = "x-attnserve-moved-to";

}  // namespace attnserve
