// The core's checks of an attention call as the native front-end decodes a
// ForwardRequest (server/native/forward_call.h): one test per invalid field
// (the code, and a message naming the field with expected and actual
// values), plus the valid edge cases and the params a valid request fills.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "server/core/validate.h"
#include "server/native/field_names.h"
#include "server/native/forward_call.h"

namespace attnserve {
namespace {

v1::Tensor MakeTensor(v1::DType dtype, std::vector<int64_t> shape) {
  v1::Tensor t;
  t.set_dtype(dtype);
  int64_t n = 1;
  for (int64_t d : shape) {
    t.add_shape(d);
    n *= d;
  }
  t.mutable_data()->assign(static_cast<size_t>(n * DTypeSize(static_cast<DType>(dtype))), '\x01');
  return t;
}

// Dense FP16: B=2, Sq=5, Sk=7, Hq=4, Hkv=2, D=16.
v1::ForwardRequest Dense(v1::DType dtype = v1::FP16) {
  v1::ForwardRequest r;
  r.set_request_id("dense");
  *r.mutable_q() = MakeTensor(dtype, {2, 5, 4, 16});
  *r.mutable_k() = MakeTensor(dtype, {2, 7, 2, 16});
  *r.mutable_v() = MakeTensor(dtype, {2, 7, 2, 16});
  return r;
}

// Varlen BF16: three sequences, the second with no queries, the third with no
// keys; Hq=4, Hkv=1 (MQA), D=32.
v1::ForwardRequest Varlen() {
  v1::ForwardRequest r;
  r.set_request_id("varlen");
  *r.mutable_q() = MakeTensor(v1::BF16, {8, 4, 32});
  *r.mutable_k() = MakeTensor(v1::BF16, {6, 1, 32});
  *r.mutable_v() = MakeTensor(v1::BF16, {6, 1, 32});
  for (int x : {0, 3, 3, 8}) r.add_cu_seqlens_q(x);
  for (int x : {0, 4, 6, 6}) r.add_cu_seqlens_k(x);
  return r;
}

absl::StatusOr<AttnParams> ValidateAndFillParams(const v1::ForwardRequest& r,
                                                 RequestLimits limits) {
  v1::ForwardResponse unused;
  return ValidateAttentionCall(ForwardCallOf(r, &unused, CallMeta{}), limits, NativeFieldNames());
}

absl::Status Validate(const v1::ForwardRequest& r, RequestLimits limits = {}) {
  return ValidateAndFillParams(r, limits).status();
}

// For requests the test knows are valid.
AttnParams FillParams(const v1::ForwardRequest& r) {
  absl::StatusOr<AttnParams> p = ValidateAndFillParams(r, {});
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : AttnParams{};
}

int64_t LseElements(const AttnParams& p) { return p.total_q * p.num_heads_q; }

// The status has `code` and a message naming `field` with expected and actual values.
void ExpectRejected(const v1::ForwardRequest& r, const std::string& field,
                    absl::StatusCode code = absl::StatusCode::kInvalidArgument,
                    RequestLimits limits = {}) {
  const absl::Status s = Validate(r, limits);
  EXPECT_EQ(s.code(), code) << s;
  const std::string message(s.message());
  EXPECT_NE(message.find(field), std::string::npos)
      << "message should name " << field << ": " << message;
  EXPECT_NE(message.find("expected"), std::string::npos) << message;
  EXPECT_NE(message.find("got"), std::string::npos) << message;
}

TEST(RequestValidationTest, AcceptsDenseInEveryDType) {
  for (v1::DType t : {v1::FP16, v1::BF16, v1::FP32, v1::FP8_E4M3}) {
    EXPECT_TRUE(Validate(Dense(t)).ok()) << v1::DType_Name(t);
  }
}

TEST(RequestValidationTest, AcceptsVarlenWithZeroLengthSequences) {
  EXPECT_TRUE(Validate(Varlen()).ok());
}

TEST(RequestValidationTest, AcceptsEdgeCases) {
  v1::ForwardRequest empty_batch = Dense();
  *empty_batch.mutable_q() = MakeTensor(v1::FP16, {0, 5, 4, 16});
  *empty_batch.mutable_k() = MakeTensor(v1::FP16, {0, 7, 2, 16});
  *empty_batch.mutable_v() = MakeTensor(v1::FP16, {0, 7, 2, 16});
  EXPECT_TRUE(Validate(empty_batch).ok());

  v1::ForwardRequest no_keys = Dense();
  *no_keys.mutable_k() = MakeTensor(v1::FP16, {2, 0, 2, 16});
  *no_keys.mutable_v() = MakeTensor(v1::FP16, {2, 0, 2, 16});
  EXPECT_TRUE(Validate(no_keys).ok());

  for (int64_t d : {8, 256}) {
    v1::ForwardRequest r = Dense();
    *r.mutable_q() = MakeTensor(v1::FP16, {1, 3, 1, d});
    *r.mutable_k() = MakeTensor(v1::FP16, {1, 3, 1, d});
    *r.mutable_v() = MakeTensor(v1::FP16, {1, 3, 1, d});
    EXPECT_TRUE(Validate(r).ok()) << "D=" << d;
  }

  v1::ForwardRequest options = Dense();
  options.mutable_options()->set_window_left(0);
  options.mutable_options()->set_window_right(0);
  options.mutable_options()->set_softmax_scale(0.5f);
  options.mutable_options()->set_softcap(30.0f);
  options.mutable_options()->set_causal(true);
  options.mutable_options()->set_return_lse(true);
  EXPECT_TRUE(Validate(options).ok());
}

// --- limits: RESOURCE_EXHAUSTED --------------------------------------------

TEST(RequestValidationTest, RequestOverByteLimit) {
  RequestLimits limits;
  limits.max_request_bytes = 1000;
  ExpectRejected(Dense(), "max_request_bytes", absl::StatusCode::kResourceExhausted, limits);
}

TEST(RequestValidationTest, DenseOverTokenLimit) {
  RequestLimits limits;
  limits.max_tokens = 2 * 5 + 2 * 7 - 1;  // one under B*Sq + B*Sk
  ExpectRejected(Dense(), "max_tokens", absl::StatusCode::kResourceExhausted, limits);
  limits.max_tokens = 2 * 5 + 2 * 7;
  EXPECT_TRUE(Validate(Dense(), limits).ok());
}

TEST(RequestValidationTest, VarlenOverTokenLimit) {
  RequestLimits limits;
  limits.max_tokens = 8 + 6 - 1;
  ExpectRejected(Varlen(), "tokens", absl::StatusCode::kResourceExhausted, limits);
}

// --- dtype -------------------------------------------------------------------

TEST(RequestValidationTest, UnspecifiedDType) {
  v1::ForwardRequest r = Dense();
  r.mutable_q()->set_dtype(v1::DTYPE_UNSPECIFIED);
  ExpectRejected(r, "q.dtype");
}

TEST(RequestValidationTest, UnknownDTypeValue) {
  v1::ForwardRequest r = Dense();
  r.mutable_v()->set_dtype(static_cast<v1::DType>(7));
  ExpectRejected(r, "v.dtype");
}

TEST(RequestValidationTest, Fp8DataIsOneBytePerElement) {
  v1::ForwardRequest r = Dense(v1::FP8_E4M3);
  EXPECT_EQ(r.q().data().size(), 2u * 5 * 4 * 16);
  r.mutable_k()->mutable_data()->append(1, '\0');
  ExpectRejected(r, "k.data");
}

TEST(RequestValidationTest, Fp8DescalesInRange) {
  v1::ForwardRequest r = Dense(v1::FP8_E4M3);
  r.mutable_options()->set_q_descale(0.01f);
  r.mutable_options()->set_k_descale(128.0f);  // the bound is inclusive
  r.mutable_options()->set_v_descale(1e-30f);
  EXPECT_TRUE(Validate(r).ok()) << Validate(r);
  const float bad[] = {0.0f, -0.5f, 128.01f, std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN()};
  for (float value : bad) {
    for (const char* field : {"q_descale", "k_descale", "v_descale"}) {
      v1::ForwardRequest b = Dense(v1::FP8_E4M3);
      v1::AttentionOptions* o = b.mutable_options();
      if (std::string(field) == "q_descale") o->set_q_descale(value);
      if (std::string(field) == "k_descale") o->set_k_descale(value);
      if (std::string(field) == "v_descale") o->set_v_descale(value);
      SCOPED_TRACE(std::string(field) + " = " + std::to_string(value));
      ExpectRejected(b, std::string("options.") + field);
      EXPECT_NE(std::string(Validate(b).message()).find("(0, 128]"), std::string::npos)
          << Validate(b);
    }
  }
}

// Descales mean nothing for other dtypes: setting one (even to 1) is refused.
TEST(RequestValidationTest, DescaleOnNonFp8Inputs) {
  for (v1::DType t : {v1::FP16, v1::BF16, v1::FP32}) {
    v1::ForwardRequest r = Dense(t);
    r.mutable_options()->set_v_descale(1.0f);
    ExpectRejected(r, "options.v_descale");
    const std::string message(Validate(r).message());
    EXPECT_NE(message.find("FP8_E4M3 inputs only"), std::string::npos) << message;
    EXPECT_NE(message.find(v1::DType_Name(t)), std::string::npos) << message;
  }
}

TEST(RequestValidationTest, MixedDTypes) {
  v1::ForwardRequest r = Dense();
  *r.mutable_k() = MakeTensor(v1::FP32, {2, 7, 2, 16});
  ExpectRejected(r, "k.dtype");
  const std::string message(Validate(r).message());
  EXPECT_NE(message.find("FP16"), std::string::npos) << message;
  EXPECT_NE(message.find("FP32"), std::string::npos) << message;
}

// --- rank and dims -------------------------------------------------------------

TEST(RequestValidationTest, QRankNeitherThreeNorFour) {
  v1::ForwardRequest r = Dense();
  *r.mutable_q() = MakeTensor(v1::FP16, {10, 64});
  ExpectRejected(r, "q.shape");
  v1::ForwardRequest unset = Dense();
  unset.clear_q();
  unset.mutable_q()->set_dtype(v1::FP16);
  ExpectRejected(unset, "q.shape");
}

TEST(RequestValidationTest, KRankDiffersFromQ) {
  v1::ForwardRequest r = Dense();
  *r.mutable_k() = MakeTensor(v1::FP16, {14, 2, 16});
  ExpectRejected(r, "k.shape");
}

TEST(RequestValidationTest, VRankDiffersFromQ) {
  v1::ForwardRequest r = Dense();
  *r.mutable_v() = MakeTensor(v1::FP16, {2, 7, 2, 16, 1});
  ExpectRejected(r, "v.shape");
}

TEST(RequestValidationTest, NegativeDim) {
  v1::ForwardRequest r = Dense();
  r.mutable_k()->set_shape(1, -7);
  ExpectRejected(r, "k.shape[1]");
}

TEST(RequestValidationTest, DimBeyondInt32) {
  v1::ForwardRequest r = Dense();
  r.mutable_q()->set_shape(1, int64_t{1} << 40);
  ExpectRejected(r, "q.shape[1]");
}

TEST(RequestValidationTest, ShapeWhoseSizeOverflows) {
  v1::ForwardRequest r = Dense();
  for (int i = 0; i < 4; ++i) r.mutable_q()->set_shape(i, 2000000000);
  ExpectRejected(r, "q.data");
}

// --- byte length ----------------------------------------------------------------

TEST(RequestValidationTest, QDataShort) {
  v1::ForwardRequest r = Dense();
  r.mutable_q()->mutable_data()->pop_back();
  ExpectRejected(r, "q.data");
  const std::string message(Validate(r).message());
  EXPECT_NE(message.find("1280 bytes"), std::string::npos) << message;  // 2*5*4*16*2
  EXPECT_NE(message.find("1279 bytes"), std::string::npos) << message;
}

TEST(RequestValidationTest, KDataLong) {
  v1::ForwardRequest r = Dense();
  r.mutable_k()->mutable_data()->push_back('\0');
  ExpectRejected(r, "k.data");
}

TEST(RequestValidationTest, VDataEmpty) {
  v1::ForwardRequest r = Dense();
  r.mutable_v()->clear_data();
  ExpectRejected(r, "v.data");
}

// --- Q/K/V consistency -----------------------------------------------------------

TEST(RequestValidationTest, VShapeDiffersFromK) {
  v1::ForwardRequest r = Dense();
  *r.mutable_v() = MakeTensor(v1::FP16, {2, 6, 2, 16});
  ExpectRejected(r, "v.shape");
}

TEST(RequestValidationTest, KBatchDiffersFromQ) {
  v1::ForwardRequest r = Dense();
  *r.mutable_k() = MakeTensor(v1::FP16, {3, 7, 2, 16});
  *r.mutable_v() = MakeTensor(v1::FP16, {3, 7, 2, 16});
  ExpectRejected(r, "k.shape[0]");
}

TEST(RequestValidationTest, KHeadDimDiffersFromQ) {
  v1::ForwardRequest r = Dense();
  *r.mutable_k() = MakeTensor(v1::FP16, {2, 7, 2, 32});
  *r.mutable_v() = MakeTensor(v1::FP16, {2, 7, 2, 32});
  ExpectRejected(r, "k.shape[3]");
}

TEST(RequestValidationTest, ZeroQueryHeads) {
  v1::ForwardRequest r = Dense();
  *r.mutable_q() = MakeTensor(v1::FP16, {2, 5, 0, 16});
  ExpectRejected(r, "q.shape[2]");
}

TEST(RequestValidationTest, ZeroKvHeads) {
  v1::ForwardRequest r = Dense();
  *r.mutable_k() = MakeTensor(v1::FP16, {2, 7, 0, 16});
  *r.mutable_v() = MakeTensor(v1::FP16, {2, 7, 0, 16});
  ExpectRejected(r, "k.shape[2]");
}

TEST(RequestValidationTest, HqNotMultipleOfHkv) {
  v1::ForwardRequest r = Dense();
  *r.mutable_k() = MakeTensor(v1::FP16, {2, 7, 3, 16});
  *r.mutable_v() = MakeTensor(v1::FP16, {2, 7, 3, 16});
  ExpectRejected(r, "k.shape[2]");
  const std::string message(Validate(r).message());
  EXPECT_NE(message.find("Hq % Hkv"), std::string::npos) << message;
}

TEST(RequestValidationTest, HeadDimOutOfRangeOrNotMultipleOf8) {
  for (int64_t d : {0, 4, 12, 100, 264, 512}) {
    v1::ForwardRequest r = Dense();
    *r.mutable_q() = MakeTensor(v1::FP16, {1, 2, 1, d});
    *r.mutable_k() = MakeTensor(v1::FP16, {1, 2, 1, d});
    *r.mutable_v() = MakeTensor(v1::FP16, {1, 2, 1, d});
    SCOPED_TRACE(d);
    ExpectRejected(r, "q.shape[3]");
  }
}

TEST(RequestValidationTest, VarlenHeadDimNamesRankThreeAxis) {
  v1::ForwardRequest r = Varlen();
  *r.mutable_q() = MakeTensor(v1::BF16, {8, 4, 20});
  *r.mutable_k() = MakeTensor(v1::BF16, {6, 1, 20});
  *r.mutable_v() = MakeTensor(v1::BF16, {6, 1, 20});
  ExpectRejected(r, "q.shape[2]");
}

// --- cu_seqlens -------------------------------------------------------------------

TEST(RequestValidationTest, DenseForbidsCuSeqlens) {
  v1::ForwardRequest r = Dense();
  r.add_cu_seqlens_q(0);
  r.add_cu_seqlens_q(5);
  ExpectRejected(r, "cu_seqlens_q");
  v1::ForwardRequest k_only = Dense();
  k_only.add_cu_seqlens_k(0);
  ExpectRejected(k_only, "cu_seqlens_k");
}

TEST(RequestValidationTest, RankThreeRequiresCuSeqlens) {
  v1::ForwardRequest r = Varlen();
  r.clear_cu_seqlens_q();
  r.clear_cu_seqlens_k();
  ExpectRejected(r, "cu_seqlens_q");
}

TEST(RequestValidationTest, CuSeqlensBothOrNeither) {
  v1::ForwardRequest no_k = Varlen();
  no_k.clear_cu_seqlens_k();
  ExpectRejected(no_k, "cu_seqlens_k");
  v1::ForwardRequest no_q = Varlen();
  no_q.clear_cu_seqlens_q();
  ExpectRejected(no_q, "cu_seqlens_q");
}

TEST(RequestValidationTest, CuSeqlensLengthsDiffer) {
  v1::ForwardRequest r = Varlen();
  r.add_cu_seqlens_k(6);
  ExpectRejected(r, "cu_seqlens_k");
}

TEST(RequestValidationTest, CuSeqlensNotStartingAtZero) {
  v1::ForwardRequest r = Varlen();
  r.set_cu_seqlens_q(0, 1);
  ExpectRejected(r, "cu_seqlens_q[0]");
}

TEST(RequestValidationTest, CuSeqlensDecreasing) {
  v1::ForwardRequest r = Varlen();
  r.set_cu_seqlens_k(2, 3);  // {0, 4, 3, 6}
  ExpectRejected(r, "cu_seqlens_k[2]");
}

TEST(RequestValidationTest, CuSeqlensLastNotTotal) {
  v1::ForwardRequest q = Varlen();
  q.set_cu_seqlens_q(3, 7);
  ExpectRejected(q, "cu_seqlens_q[3]");
  const std::string message(Validate(q).message());
  EXPECT_NE(message.find("Tq = 8"), std::string::npos) << message;
  v1::ForwardRequest k = Varlen();
  k.set_cu_seqlens_k(3, 9);
  k.set_cu_seqlens_k(2, 9);
  ExpectRejected(k, "cu_seqlens_k[3]");
}

// --- options --------------------------------------------------------------------

TEST(RequestValidationTest, NegativeWindowLeft) {
  v1::ForwardRequest r = Dense();
  r.mutable_options()->set_window_left(-1);
  ExpectRejected(r, "options.window_left");
}

TEST(RequestValidationTest, NegativeWindowRight) {
  v1::ForwardRequest r = Dense();
  r.mutable_options()->set_window_right(-5);
  ExpectRejected(r, "options.window_right");
}

TEST(RequestValidationTest, BadSoftmaxScale) {
  for (float scale : {0.0f, -0.125f, std::numeric_limits<float>::quiet_NaN(),
                      std::numeric_limits<float>::infinity()}) {
    v1::ForwardRequest r = Dense();
    r.mutable_options()->set_softmax_scale(scale);
    SCOPED_TRACE(scale);
    ExpectRejected(r, "options.softmax_scale");
  }
}

TEST(RequestValidationTest, BadSoftcap) {
  for (float cap :
       {-1.0f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    v1::ForwardRequest r = Dense();
    r.mutable_options()->set_softcap(cap);
    SCOPED_TRACE(cap);
    ExpectRejected(r, "options.softcap");
  }
}

// Values once accepted and answered with an all-NaN O.
TEST(RequestValidationTest, SoftmaxScaleBeyondFloatSafeRange) {
  for (float scale : {2e38f, 1.0001e26f, std::numeric_limits<float>::max()}) {
    v1::ForwardRequest r = Dense();
    r.mutable_options()->set_softmax_scale(scale);
    SCOPED_TRACE(scale);
    ExpectRejected(r, "options.softmax_scale");
    EXPECT_NE(std::string(Validate(r).message()).find("1e+26"), std::string::npos)
        << "the message states the accepted range: " << Validate(r).message();
  }
}

TEST(RequestValidationTest, SoftcapBeyondFloatSafeRange) {
  // Default scale 1/sqrt(16) = 0.25: the smallest softcap is 0.25 / 1e26.
  for (float cap : {1e-45f, 1e-39f, 2e-27f, 3e38f, 1.0001e26f}) {
    v1::ForwardRequest r = Dense();
    r.mutable_options()->set_softcap(cap);
    SCOPED_TRACE(cap);
    ExpectRejected(r, "options.softcap");
    const std::string message(Validate(r).message());
    EXPECT_NE(message.find("2.5e-27"), std::string::npos) << message;
    EXPECT_NE(message.find("1e+26"), std::string::npos) << message;
  }
  // The lower bound follows the scale in use.
  v1::ForwardRequest r = Dense();
  r.mutable_options()->set_softmax_scale(1e-20f);
  r.mutable_options()->set_softcap(1e-39f);
  EXPECT_TRUE(Validate(r).ok()) << Validate(r);
}

TEST(RequestValidationTest, AcceptsScaleAndSoftcapAtTheirBounds) {
  struct Case {
    float scale;  // 0: unset (1/sqrt(16) = 0.25)
    float softcap;
  };
  for (const Case& c :
       {Case{1e26f, 0.0f}, Case{1e26f, 1.0f}, Case{1e26f, 1e26f}, Case{0.0f, 0.25f / 1e26f},
        Case{0.0f, 1e26f}, Case{std::numeric_limits<float>::denorm_min(), 0.0f}}) {
    v1::ForwardRequest r = Dense();
    if (c.scale != 0.0f) r.mutable_options()->set_softmax_scale(c.scale);
    r.mutable_options()->set_softcap(c.softcap);
    SCOPED_TRACE(::testing::Message() << "scale " << c.scale << " softcap " << c.softcap);
    EXPECT_TRUE(Validate(r).ok()) << Validate(r);
  }
}

TEST(RequestValidationTest, RequestIdLongerThanTheLimit) {
  v1::ForwardRequest r = Dense();
  r.set_request_id(std::string(kMaxRequestIdBytes, 'x'));
  EXPECT_TRUE(Validate(r).ok()) << Validate(r);
  r.set_request_id(std::string(kMaxRequestIdBytes + 1, 'x'));
  ExpectRejected(r, "request_id");
  EXPECT_NE(std::string(Validate(r).message()).find("1024"), std::string::npos);
  r.set_request_id(std::string(8 << 20, 'x'));  // the 8 MiB id of the finding
  ExpectRejected(r, "request_id");
}

// --- FillParams -------------------------------------------------------------------

TEST(FillParamsTest, Fp8Descales) {
  v1::ForwardRequest r = Dense(v1::FP8_E4M3);
  absl::StatusOr<AttnParams> p = ValidateAndFillParams(r, {});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->dtype, DType::kFP8E4M3);
  EXPECT_EQ(OutputDType(p->dtype), DType::kBF16);
  // Unset means 1, never 0.
  EXPECT_EQ(p->q_descale, 1.0f);
  EXPECT_EQ(p->k_descale, 1.0f);
  EXPECT_EQ(p->v_descale, 1.0f);
  r.mutable_options()->set_q_descale(0.5f);
  r.mutable_options()->set_k_descale(3.0f);
  r.mutable_options()->set_v_descale(0.125f);
  p = ValidateAndFillParams(r, {});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->q_descale, 0.5f);
  EXPECT_EQ(p->k_descale, 3.0f);
  EXPECT_EQ(p->v_descale, 0.125f);
}

TEST(FillParamsTest, DenseDefaults) {
  const v1::ForwardRequest r = Dense(v1::BF16);
  absl::StatusOr<AttnParams> p = ValidateAndFillParams(r, {});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->dtype, DType::kBF16);
  EXPECT_EQ(p->batch, 2);
  EXPECT_EQ(p->seqlen_q, 5);
  EXPECT_EQ(p->seqlen_k, 7);
  EXPECT_EQ(p->num_heads_q, 4);
  EXPECT_EQ(p->num_heads_kv, 2);
  EXPECT_EQ(p->head_dim, 16);
  EXPECT_EQ(p->total_q, 10);
  EXPECT_EQ(p->total_k, 14);
  EXPECT_EQ(p->q, r.q().data().data());
  EXPECT_EQ(p->k, r.k().data().data());
  EXPECT_EQ(p->v, r.v().data().data());
  EXPECT_EQ(p->o, nullptr);
  EXPECT_EQ(p->lse, nullptr);
  EXPECT_EQ(p->cu_seqlens_q, nullptr);
  EXPECT_EQ(p->cu_seqlens_k, nullptr);
  EXPECT_FLOAT_EQ(p->softmax_scale, 0.25f);  // 1/sqrt(16)
  EXPECT_FLOAT_EQ(p->softmax_scale_log2, 0.25f * static_cast<float>(M_LOG2E));
  EXPECT_EQ(p->softcap, 0.0f);
  EXPECT_FALSE(p->is_causal);
  EXPECT_EQ(p->window_left, kNoWindow);
  EXPECT_EQ(p->window_right, kNoWindow);
  EXPECT_EQ(p->total_q * p->num_heads_q * p->head_dim, 10 * 4 * 16);  // O elements
  EXPECT_EQ(LseElements(*p), 10 * 4);
}

TEST(FillParamsTest, OptionsAndCausal) {
  v1::ForwardRequest r = Dense();
  r.mutable_options()->set_softmax_scale(0.5f);
  r.mutable_options()->set_softcap(20.0f);
  r.mutable_options()->set_window_left(3);
  r.mutable_options()->set_window_right(2);
  AttnParams p = FillParams(r);
  EXPECT_FLOAT_EQ(p.softmax_scale, 0.5f);
  EXPECT_FLOAT_EQ(p.softcap, 20.0f);
  EXPECT_EQ(p.window_left, 3);
  EXPECT_EQ(p.window_right, 2);
  EXPECT_FALSE(p.is_causal);

  // Causal is the right bound at the diagonal, whatever window_right says.
  r.mutable_options()->set_causal(true);
  p = FillParams(r);
  EXPECT_TRUE(p.is_causal);
  EXPECT_EQ(p.window_left, 3);
  EXPECT_EQ(p.window_right, 0);
  r.mutable_options()->clear_window_right();
  r.mutable_options()->clear_window_left();
  p = FillParams(r);
  EXPECT_EQ(p.window_left, kNoWindow);
  EXPECT_EQ(p.window_right, 0);
}

TEST(FillParamsTest, Varlen) {
  const v1::ForwardRequest r = Varlen();
  absl::StatusOr<AttnParams> p = ValidateAndFillParams(r, {});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->batch, 3);
  EXPECT_EQ(p->total_q, 8);
  EXPECT_EQ(p->total_k, 6);
  EXPECT_EQ(p->seqlen_q, 5);  // the longest: 8 - 3
  EXPECT_EQ(p->seqlen_k, 4);
  EXPECT_EQ(p->num_heads_q, 4);
  EXPECT_EQ(p->num_heads_kv, 1);
  EXPECT_EQ(p->head_dim, 32);
  EXPECT_EQ(p->cu_seqlens_q, r.cu_seqlens_q().data());
  EXPECT_EQ(p->cu_seqlens_k, r.cu_seqlens_k().data());
  EXPECT_TRUE(IsVarlen(*p));
  EXPECT_FLOAT_EQ(p->softmax_scale, 1.0f / std::sqrt(32.0f));
}

}  // namespace
}  // namespace attnserve
