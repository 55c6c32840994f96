// Where the tokens of one (sequence, layer) of a K/V cache that spans devices
// lie (docs/kv-cache.md, "Caches that span devices"): contiguous segments of
// token rows, each on one device (a shard of the cache) in pages of its own.
// The sequence's block table is the segments' pages in token order; segment
// k holds tokens [token_begin_k, token_begin_{k+1}) (the last one up to the
// length) in pages [page_begin_k, page_begin_{k+1}) of the table, starting on
// a fresh page. A cache on one device keeps no segment list: its one
// implicit segment starts at token 0 and page 0 on shard 0.
#pragma once

#include <cstdint>
#include <vector>

namespace attnserve {

struct KvSegment {
  int32_t shard = 0;        // the cache's shard (device) holding its pages
  int32_t token_begin = 0;  // the sequence's first token in it
  int32_t page_begin = 0;   // its first page's index in the block table
};

// Pages of a table whose tokens past `length` are dropped, and the segments
// that keep a token (those that start at or past `length` go). An empty list
// is the one-device form: ceil(length / page_size) pages.
int64_t KeepSegments(std::vector<KvSegment>* segments, int32_t length, int page_size);

// Where an append of pages goes. The sequence's last segment keeps growing
// while its shard has the pages the append needs there (`extend_pages`, -1
// when there is no segment yet, int64 max when the segment may not grow);
// otherwise a new segment opens on the shard
// with the most free pages (the first on a tie) if it has `open_pages`.
// Returns {shard, true: extends the last segment} or shard -1 when no shard
// has room. `free_pages` is per shard.
struct KvPlacement {
  int shard = -1;
  bool extend = false;
};
KvPlacement PlaceAppend(const std::vector<int64_t>& free_pages, int last_shard,
                        int64_t extend_pages, int64_t open_pages);

}  // namespace attnserve
