// The score modifiers and masks of one attention call on the client side
// (attnserve.v1.AttentionOptions alibi_slopes, sinks, bias, mask, block_mask):
// host arrays the request builder copies to the wire and the verifier hands to
// the float64 reference. Semantics and layouts: backend/params.h and the proto.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"
#include "backend/make_params.h"
#include "client/host_tensor.h"

namespace attnserve {

struct InputsSummary;

// A boolean mask, one byte per element (0 = masked), the bias's shapes.
struct ElementMaskData {
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};

// A block mask in compressed sparse rows (attnserve.v1.BlockMask).
struct BlockMaskData {
  int32_t block_q = kBlockMaskGrain;
  int32_t block_k = kBlockMaskGrain;
  int32_t num_batch = 1;  // B or 1 (varlen: B)
  int32_t num_heads = 1;  // Hq or 1
  std::vector<int32_t> row_ptr;
  std::vector<int32_t> col_idx;

  // Kept (query block, key block) pairs over all rows.
  int64_t kept() const { return static_cast<int64_t>(col_idx.size()); }
};

struct ScoreMods {
  std::vector<float> alibi_slopes;  // [Hq] or empty
  std::vector<float> sinks;         // [Hq] or empty
  std::optional<HostTensor> bias;   // FP32, FP16 or BF16
  std::optional<ElementMaskData> mask;
  std::optional<BlockMaskData> block_mask;

  bool empty() const {
    return alibi_slopes.empty() && sinks.empty() && !bias && !mask && !block_mask;
  }
};

// Fields 10..14 of `to` from `from` (the tensors' bytes are copied).
void ScoreModsToProto(const ScoreMods& from, v1::AttentionOptions* to);

// "alibi sinks bias=FP32[1, 8, 128, 128] block_mask=128x128 kept 25.0%", or "".
std::string ScoreModsString(const ScoreMods& mods);

// INVALID_ARGUMENT naming the field (alibi_slopes, sinks, bias, mask,
// block_mask.*) when `mods` do not fit the call `s` (cu_seqlens: the call's,
// empty when dense): sizes, broadcast shapes, non-finite values, CSR
// structure and index ranges, block sizes. The verifier reads the arrays
// through these shapes, so it refuses what would read out of bounds.
absl::Status CheckScoreMods(const ScoreMods& mods, const InputsSummary& s,
                            const std::vector<int32_t>& cu_seqlens_q,
                            const std::vector<int32_t>& cu_seqlens_k);

// AttnMods viewing `mods` (which must outlive them and have passed
// CheckScoreMods), with the broadcast flags the shapes imply.
AttnMods AttnModsOf(const ScoreMods& mods, const InputsSummary& s);

// The ALiBi paper's slopes for `num_heads` heads: the geometric sequence
// 2^(-8/n), 2^(-16/n), ... for n a power of two; otherwise the slopes of the
// largest power of two below n, then every other slope of twice that, as the
// paper's reference code (and BLOOM) does.
std::vector<float> AlibiSlopes(int num_heads);

// Key blocks kept per query block: `random` keeps round(density × n) of the n
// key blocks of each row, chosen uniformly; `stripes` keeps the same number as
// global columns (the first quarter of them) plus a local band that ends at
// the row's diagonal block (bottom-right aligned).
enum class BlockPattern { kRandom, kStripes };

// A block mask with one row per (sequence, head, query block) of the call `s`
// (num_batch = B, num_heads = Hq), `density` in [0, 1]. INVALID_ARGUMENT for a
// density outside [0, 1] or block sizes that are not positive multiples of
// kBlockMaskGrain.
absl::StatusOr<BlockMaskData> MakeBlockMask(BlockPattern pattern, double density, int32_t block_q,
                                            int32_t block_k, const InputsSummary& s,
                                            const std::vector<int32_t>& cu_seqlens_q,
                                            const std::vector<int32_t>& cu_seqlens_k,
                                            std::mt19937_64* rng);

}  // namespace attnserve
