// How --max_buffered_bytes (B) is split among the budgets that charge it, so
// that together they hold at most B (SECURITY.md, "Memory budget"): the one
// place the split is decided.
#pragma once

#include <cstdint>

namespace attnserve {

struct BufferedShares {
  // gRPC's own receive buffers and messages being received (its ResourceQuota).
  int64_t grpc = 0;
  // What streams hold once read, and HTTP bodies with their parsed tensors.
  int64_t streams = 0;
  // Bytes held outside both: UCX step frames, UCX K/V imports' and exports'
  // staging buffers, --handoff_peer pushes' send windows.
  int64_t outside = 0;
};

// B/4 for gRPC, B/2 for streams and HTTP, the rest (B/4) outside them.
inline BufferedShares SplitBufferedBytes(int64_t total) {
  BufferedShares s;
  s.streams = total / 2;
  s.grpc = total / 4;
  s.outside = total - s.streams - s.grpc;
  return s;
}

}  // namespace attnserve
