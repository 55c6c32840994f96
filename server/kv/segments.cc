// Segments of a sequence that spans devices; see segments.h.
#include "server/kv/segments.h"

#include <cstddef>

namespace attnserve {

int64_t KeepSegments(std::vector<KvSegment>* segments, int32_t length, int page_size) {
  auto pages_for = [page_size](int64_t tokens) { return (tokens + page_size - 1) / page_size; };
  if (segments->empty()) return pages_for(length);
  while (!segments->empty() && segments->back().token_begin >= length) segments->pop_back();
  if (segments->empty()) return 0;
  const KvSegment& last = segments->back();
  return last.page_begin + pages_for(int64_t{length} - last.token_begin);
}

KvPlacement PlaceAppend(const std::vector<int64_t>& free_pages, int last_shard,
                        int64_t extend_pages, int64_t open_pages) {
  if (last_shard >= 0 && extend_pages <= free_pages[size_t(last_shard)]) {
    return {last_shard, true};
  }
  int best = -1;
  for (size_t s = 0; s < free_pages.size(); ++s) {
    if (best < 0 || free_pages[s] > free_pages[size_t(best)]) best = static_cast<int>(s);
  }
  if (best < 0 || free_pages[size_t(best)] < open_pages) return {};
  return {best, false};
}

}  // namespace attnserve
