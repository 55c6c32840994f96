// What the K/V step tests over the wire share: the geometry (FP32, pages of
// kPage tokens), the client's copy of each sequence's tokens, the
// AppendAttend request for one step of several sequences, a check of O and
// LSE rows against the float64 reference, and a fixture holding a real
// AttnServer (CPU backend) with one cache of one layer.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "attnserve/v1/kv.grpc.pb.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/server.h"

namespace attnserve {

constexpr int kHq = 4, kHkv = 2, kD = 16, kPage = 16;
constexpr int64_t kKvRow = kHkv * kD, kQRow = kHq * kD;

// `n` values from the standard normal distribution.
std::vector<float> Random(std::mt19937* rng, int64_t n);

// One sequence's tokens at one layer, as the client appended them.
struct Context {
  std::vector<float> k, v;  // [len, Hkv, D]
  int32_t length() const { return int32_t(k.size() / kKvRow); }
};

// One sequence's part of a call: new K/V rows and queries.
struct Part {
  uint64_t id = 0;
  int32_t expected = 0;
  std::vector<float> k, v, q;
  std::vector<int32_t> attend_pages;
};

// The per-head modifiers of a call; empty = unset.
struct Mods {
  std::vector<float> slopes, sinks;
};

// `t` as FP32 [rows, heads, kD] holding `data`.
void SetFp32Tensor(v1::Tensor* t, int64_t rows, int64_t heads, std::string data);

// One AppendAttend call (layer 0) of `parts`, returning LSE.
v1::AppendAttendRequest MakeCall(const std::string& cache, const std::vector<Part>& parts,
                                 const Mods& mods, bool causal = true);
v1::AppendAttendRequest MakeCall(const std::string& cache, const std::vector<Part>& parts,
                                 bool causal = true);

// O rows [row0, row0 + nq) of a response (LSE [Hq, total_q]) against the
// float64 reference of those queries over `keys` of `ctx` (all of them when
// unset) with `mods`: a dense call of one sequence, so ALiBi and causal are
// bottom-right against the keys it attends.
::testing::AssertionResult RowsMatch(const std::string& o_bytes, const std::string& lse_bytes,
                                     int64_t total_q, int64_t row0, const float* q, int nq,
                                     const Context& ctx, const Mods& mods, bool causal,
                                     const std::optional<std::vector<int32_t>>& keys = {});

// The keys query row `i` of part `j`'s `nq` rows may see.
using VisibleKeysFn = std::function<std::vector<int32_t>(size_t j, int i, int nq)>;

// Checks `resp` to `parts` (made on `ctxs`): one length per part, then each
// part's query rows against the reference with `mods`, over all its K/V
// (causal as asked) or, given `visible`, each row over exactly its keys.
void CheckResponse(const v1::AppendAttendResponse& resp, const std::vector<Part>& parts,
                   const std::vector<Context*>& ctxs, const Mods& mods, bool causal = true,
                   const VisibleKeysFn& visible = nullptr);

// A real AttnServer on 127.0.0.1:0 (CPU backend, pages of kPage tokens) with
// native K/V and KServe v2 stubs and an FP32 cache `cache_` of one layer.
class KvStepTest : public ::testing::Test {
 protected:
  explicit KvStepTest(uint32_t seed) : rng_(seed) {}
  void SetUp() override;
  void TearDown() override;

  grpc::Status Call(const v1::AppendAttendRequest& r, v1::AppendAttendResponse* resp);
  void CreateSequences(std::vector<uint64_t> ids);
  // The length of sequence `id`; -1 (a failure unless `may_be_missing`) when
  // the cache does not hold it.
  int32_t Length(uint64_t id, bool may_be_missing = false);
  // A part appending `n` tokens with `nq` queries; `ctx` gains the tokens.
  Part Step(uint64_t id, Context* ctx, int n, int nq, std::vector<int32_t> pages = {});
  // `r` is refused with INVALID_ARGUMENT whose message holds every one of
  // `words`; sequence `id` keeps length `length`.
  void ExpectRefused(const v1::AppendAttendRequest& r, const std::vector<std::string>& words,
                     uint64_t id, int32_t length);
  // The attention_kv request (q, k, v FP32, causal, LSE) for `part` in `cache_`.
  inference::ModelInferRequest AttentionKv(const Part& part) const;
  grpc::Status Infer(const inference::ModelInferRequest& r, inference::ModelInferResponse* out);

  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> v2_;
  std::string cache_;
  std::mt19937 rng_;
};

}  // namespace attnserve
