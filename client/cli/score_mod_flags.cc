// ScoreMods from attnctl forward's flags (see score_mod_flags.h).
#include "client/cli/score_mod_flags.h"

#include <cmath>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/npy.h"
#include "client/score_mods.h"

namespace attnserve {
namespace cli {
namespace {

absl::Status Usage(std::string message) { return absl::InvalidArgumentError(message); }

// A flag's file error with the flag in front: "--bias: cannot open x.npy: ...".
absl::Status FlagError(const char* flag, const absl::Status& st) {
  return absl::Status(st.code(), absl::StrCat("--", flag, ": ", st.message()));
}

absl::StatusOr<std::vector<float>> ParseSinks(const std::string& text, int64_t heads) {
  std::vector<float> values;
  if (absl::EndsWith(text, ".npy")) {
    absl::StatusOr<HostTensor> t = ReadNpy(text);
    if (!t.ok()) return FlagError("sinks", t.status());
    if (t->rank() != 1 || t->dim(0) != heads || t->dtype() == DType::kFP8E4M3) {
      return Usage(absl::StrCat("--sinks ", text, " is ", t->DebugString(),
                                ", expected one float per query head: [", heads, "]"));
    }
    values = t->ToFloats();
  } else {
    for (absl::string_view item : absl::StrSplit(text, ',')) {
      float v = 0.0f;
      if (!absl::SimpleAtof(absl::StripAsciiWhitespace(item), &v)) {
        return Usage(
            absl::StrCat("--sinks: '", item, "' is not a number (expected a value for every head, ",
                         heads, " comma-separated values, or an FP32 .npy file of [", heads, "])"));
      }
      values.push_back(v);
    }
    if (values.size() == 1) values.assign(static_cast<size_t>(heads), values[0]);
    if (static_cast<int64_t>(values.size()) != heads) {
      return Usage(absl::StrCat("--sinks lists ", values.size(), " values, expected 1 or ", heads,
                                " (one per query head)"));
    }
  }
  for (size_t h = 0; h < values.size(); ++h) {
    if (!std::isfinite(values[h])) {
      return Usage(
          absl::StrCat("--sinks: the value of head ", h, " must be finite, got ", values[h]));
    }
  }
  return values;
}

absl::StatusOr<std::pair<int32_t, int32_t>> ParseBlockSize(const std::string& text) {
  std::vector<std::string> parts = absl::StrSplit(text, ',');
  std::vector<int32_t> sizes;
  for (const std::string& p : parts) {
    int32_t v = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(p), &v) || v <= 0 ||
        v % kBlockMaskGrain != 0) {
      return Usage(absl::StrCat("--block_size: '", p, "' is not a positive multiple of ",
                                kBlockMaskGrain, " (expected Q or Q,K, e.g. 128 or 256,128)"));
    }
    sizes.push_back(v);
  }
  if (sizes.size() > 2) {
    return Usage(absl::StrCat("--block_size: expected Q or Q,K, got '", text, "'"));
  }
  return std::pair{sizes[0], sizes.size() == 2 ? sizes[1] : sizes[0]};
}

}  // namespace

absl::StatusOr<ScoreMods> ScoreModsFromFlags(const ScoreModFlags& f, const AttentionInputs& in,
                                             const InputsSummary& s, uint64_t seed) {
  ScoreMods mods;
  if (f.alibi) mods.alibi_slopes = AlibiSlopes(static_cast<int>(s.heads_q));
  if (!f.sinks.empty()) {
    absl::StatusOr<std::vector<float>> sinks = ParseSinks(f.sinks, s.heads_q);
    if (!sinks.ok()) return sinks.status();
    mods.sinks = *std::move(sinks);
  }
  if (!f.bias.empty()) {
    absl::StatusOr<HostTensor> bias = ReadNpy(f.bias);
    if (!bias.ok()) return FlagError("bias", bias.status());
    if (bias->dtype() == DType::kFP8E4M3) {
      return Usage(absl::StrCat("--bias ", f.bias,
                                ": a uint8 file is not a bias (expected '<f4', '<f2', '<f8' or "
                                "'<u2' BF16 bits)"));
    }
    mods.bias = *std::move(bias);
  }
  if (!f.mask.empty()) {
    absl::StatusOr<NpyMask> mask = ReadNpyMask(f.mask);
    if (!mask.ok()) return FlagError("mask", mask.status());
    mods.mask = ElementMaskData{std::move(mask->shape), std::move(mask->data)};
  }
  if (!f.block_density) {
    if (f.block_size_set || f.block_pattern_set) {
      return Usage("--block_size and --block_pattern need --block_density (the kept fraction)");
    }
  } else {
    BlockPattern pattern;
    if (f.block_pattern == "random") {
      pattern = BlockPattern::kRandom;
    } else if (f.block_pattern == "stripes") {
      pattern = BlockPattern::kStripes;
    } else {
      return Usage(
          absl::StrCat("--block_pattern: expected random or stripes, got '", f.block_pattern, "'"));
    }
    const double density = *f.block_density;
    if (!(density >= 0.0 && density <= 1.0)) {
      return Usage(absl::StrCat("--block_density: expected a fraction in [0, 1], got ", density));
    }
    absl::StatusOr<std::pair<int32_t, int32_t>> size = ParseBlockSize(f.block_size);
    if (!size.ok()) return size.status();
    std::mt19937_64 rng(seed ^ 0x6a09e667f3bcc909ull);  // not the inputs' stream
    absl::StatusOr<BlockMaskData> block = MakeBlockMask(pattern, density, size->first, size->second,
                                                        s, in.cu_seqlens_q, in.cu_seqlens_k, &rng);
    if (!block.ok()) return Usage(absl::StrCat("--block_density: ", block.status().message()));
    mods.block_mask = *std::move(block);
  }
  // Shapes against the call, named by the flag that gave them.
  const absl::Status st = CheckScoreMods(mods, s, in.cu_seqlens_q, in.cu_seqlens_k);
  if (!st.ok()) {
    const absl::string_view msg = st.message();
    const char* flag = absl::StartsWith(msg, "bias")    ? "--bias"
                       : absl::StartsWith(msg, "mask")  ? "--mask"
                       : absl::StartsWith(msg, "sinks") ? "--sinks"
                       : absl::StartsWith(msg, "block") ? "--block_density"
                                                        : "--alibi";
    return Usage(absl::StrCat(flag, ": ", msg));
  }
  return mods;
}

}  // namespace cli
}  // namespace attnserve
