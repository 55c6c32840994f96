// HostTensor, dtype parsing, random inputs, input checks and request building:
// everything of the client library that runs without a server.
#include "client/host_tensor.h"

#include <cmath>
#include <string>
#include <vector>

#include "client/attention_client.h"
#include "client/inputs.h"
#include "common/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

TEST(HostTensorTest, FromFloatsRoundsToTheDtype) {
  const std::vector<float> values = {1.0f, -0.333333f, 1e-5f, 70000.0f, 3.0e-8f};
  for (DType dtype : {DType::kFP16, DType::kBF16, DType::kFP32}) {
    auto t = HostTensor::FromFloats(dtype, {5}, values);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->bytes().size(), 5u * DTypeSize(dtype));
    const std::vector<float> back = t->ToFloats();
    for (size_t i = 0; i < values.size(); ++i) {
      const float want = RoundTo(dtype, values[i]);
      EXPECT_EQ(back[i], want) << DTypeName(dtype) << " element " << i;
    }
  }
}

TEST(HostTensorTest, ConvertToRounds) {
  auto t = HostTensor::FromFloats(DType::kFP32, {2, 2}, {1.0f, 0.1f, -2.5f, 1000.1f});
  const HostTensor h = t->ConvertTo(DType::kFP16);
  EXPECT_EQ(h.dtype(), DType::kFP16);
  EXPECT_EQ(h.shape(), t->shape());
  EXPECT_EQ(h.ToFloats()[1], Fp16ToFloat(FloatToFp16(0.1f)));
  EXPECT_EQ(h.DebugString(), "FP16[2, 2]");
}

TEST(HostTensorTest, RejectsWrongSizes) {
  auto few = HostTensor::FromFloats(DType::kFP32, {2, 3}, {1.f, 2.f});
  EXPECT_EQ(few.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(few.status().message(), HasSubstr("needs 6 values, got 2"));

  auto bytes = HostTensor::FromBytes(DType::kFP16, {4}, std::string(7, '\0'));
  EXPECT_THAT(bytes.status().message(), HasSubstr("needs 4 * 2 bytes, got 7"));

  auto negative = HostTensor::FromBytes(DType::kFP16, {2, -1}, "");
  EXPECT_THAT(negative.status().message(), HasSubstr("dimension 1 is negative"));

  auto huge = NumElementsOf({int64_t{1} << 40, int64_t{1} << 40});
  EXPECT_FALSE(huge.ok());
}

TEST(HostTensorTest, ProtoRoundTripAndChecks) {
  auto t = HostTensor::FromFloats(DType::kBF16, {1, 2, 1, 8}, std::vector<float>(16, 0.5f));
  v1::Tensor proto;
  t->CopyToProto(&proto);
  EXPECT_EQ(proto.dtype(), v1::BF16);
  EXPECT_EQ(proto.shape_size(), 4);
  EXPECT_EQ(proto.data().size(), 32u);
  auto back = HostTensor::FromProto(proto);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->bytes(), t->bytes());

  HostTensor moved = *t;
  v1::Tensor proto2;
  std::move(moved).MoveToProto(&proto2);
  EXPECT_EQ(proto2.data(), t->bytes());

  proto.set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_THAT(HostTensor::FromProto(proto).status().message(), HasSubstr("DTYPE_UNSPECIFIED"));
  proto.set_dtype(v1::FP32);  // 32 bytes are 8 FP32 values, not 16
  EXPECT_THAT(HostTensor::FromProto(proto).status().message(), HasSubstr("needs 16 * 4 bytes"));
}

TEST(HostTensorTest, ConcatRowsAndSliceRowsBuildAndSplitTheVarlenLayout) {
  auto a = HostTensor::FromFloats(DType::kFP16, {1, 2, 2}, {1, 2, 3, 4});
  auto b = HostTensor::FromFloats(DType::kFP16, {2, 2, 2}, {5, 6, 7, 8, 9, 10, 11, 12});
  auto empty = HostTensor::FromFloats(DType::kFP16, {0, 2, 2}, {});
  ASSERT_TRUE(a.ok() && b.ok() && empty.ok());
  auto all = ConcatRows({*a, *empty, *b}, DType::kFP32, {});
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->shape(), (std::vector<int64_t>{3, 2, 2}));
  EXPECT_EQ(all->ToFloats(), (std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}));
  auto second = all->SliceRows(1, 2);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->bytes(), b->bytes());
  EXPECT_EQ(all->SliceRows(3, 0)->shape(), (std::vector<int64_t>{0, 2, 2}));
  EXPECT_EQ(all->SliceRows(2, 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(all->SliceRows(-1, 1).status().code(), absl::StatusCode::kInvalidArgument);
  // No parts: an empty tensor of the given trailing shape.
  auto none = ConcatRows({}, DType::kBF16, {7, 4, 8});
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->DebugString(), "BF16[0, 4, 8]");
  // Parts must agree beyond the first dimension.
  auto c = HostTensor::FromFloats(DType::kFP16, {1, 4}, {1, 2, 3, 4});
  const auto mixed = ConcatRows({*a, *c}, DType::kFP16, {});
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(mixed.status().message()), ::testing::HasSubstr("part 1 is FP16[1, 4]"));
}

TEST(HostTensorTest, ParseDType) {
  EXPECT_EQ(*ParseDType("fp16"), DType::kFP16);
  EXPECT_EQ(*ParseDType("BF16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("float32"), DType::kFP32);
  EXPECT_EQ(*ParseDType("fp8_e4m3"), DType::kFP8E4M3);
  EXPECT_EQ(*ParseDType("float8_e4m3fn"), DType::kFP8E4M3);
  auto bad = ParseDType("fp8");
  EXPECT_THAT(bad.status().message(), HasSubstr("unknown dtype 'fp8'"));
}

TEST(InputsTest, RandomDenseInputsHaveTheShapeAndNoZeros) {
  AttentionShape s;
  s.dtype = DType::kBF16;
  s.batch = 2;
  s.seqlen_q = 17;
  s.seqlen_k = 33;
  s.heads_q = 8;
  s.heads_kv = 2;
  s.head_dim = 16;
  auto in = MakeRandomInputs(s, 7);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->q.shape(), (std::vector<int64_t>{2, 17, 8, 16}));
  EXPECT_EQ(in->k.shape(), (std::vector<int64_t>{2, 33, 2, 16}));
  EXPECT_EQ(in->v.shape(), in->k.shape());
  EXPECT_TRUE(in->cu_seqlens_q.empty());
  for (const HostTensor* t : {&in->q, &in->k, &in->v}) {
    for (float x : t->ToFloats()) ASSERT_GE(std::fabs(x), 1e-3f);
  }
  // Same seed, same inputs; another seed, other inputs; k and v differ.
  EXPECT_EQ(MakeRandomInputs(s, 7)->q.bytes(), in->q.bytes());
  EXPECT_NE(MakeRandomInputs(s, 8)->q.bytes(), in->q.bytes());
  EXPECT_NE(in->k.bytes(), in->v.bytes());

  auto summary = SummarizeInputs(*in);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->ToString(), "dense B=2 Sq=17 Sk=33 Hq=8 Hkv=2 D=16 BF16");
}

TEST(InputsTest, RandomVarlenInputs) {
  AttentionShape s;
  s.dtype = DType::kFP16;
  s.heads_q = 4;
  s.heads_kv = 1;
  s.head_dim = 8;
  s.seqlens_q = {3, 0, 17};
  s.seqlens_k = {5, 4, 0};
  auto in = MakeRandomInputs(s, 1);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->q.shape(), (std::vector<int64_t>{20, 4, 8}));
  EXPECT_EQ(in->k.shape(), (std::vector<int64_t>{9, 1, 8}));
  EXPECT_EQ(in->cu_seqlens_q, (std::vector<int32_t>{0, 3, 3, 20}));
  EXPECT_EQ(in->cu_seqlens_k, (std::vector<int32_t>{0, 5, 9, 9}));
  auto summary = SummarizeInputs(*in);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_TRUE(summary->varlen);
  EXPECT_EQ(summary->batch, 3);
  EXPECT_EQ(summary->seqlen_q, 17);
  EXPECT_EQ(summary->seqlen_k, 5);
}

TEST(InputsTest, RejectsBadShapes) {
  AttentionShape s;
  s.heads_q = 6;
  s.heads_kv = 4;
  EXPECT_THAT(MakeRandomInputs(s, 0).status().message(), HasSubstr("multiple of heads_kv"));
  s.heads_kv = 3;
  s.seqlens_q = {1, 2};
  s.seqlens_k = {1};
  EXPECT_THAT(MakeRandomInputs(s, 0).status().message(), HasSubstr("same number of sequences"));

  s.seqlens_k = {1, 2};
  auto in = MakeRandomInputs(s, 0);
  ASSERT_TRUE(in.ok());
  in->cu_seqlens_q = {0, 2, 1};
  EXPECT_THAT(SummarizeInputs(*in).status().message(), HasSubstr("non-decreasing"));
  in->cu_seqlens_q = {0, 1, 4};
  EXPECT_THAT(SummarizeInputs(*in).status().message(), HasSubstr("must end at q.shape[0] = 3"));
  in->cu_seqlens_q.clear();
  in->cu_seqlens_k.clear();
  EXPECT_THAT(SummarizeInputs(*in).status().message(), HasSubstr("must have rank 4"));
}

TEST(RequestTest, MakeForwardRequestSetsOnlyGivenOptions) {
  AttentionShape s;
  s.seqlen_q = s.seqlen_k = 4;
  s.head_dim = 8;
  auto in = MakeRandomInputs(s, 3);
  ASSERT_TRUE(in.ok());
  in->request_id = "r1";
  in->options.causal = true;
  in->options.window_left = 2;
  in->options.return_lse = true;
  v1::ForwardRequest req = MakeForwardRequest(*in);
  EXPECT_EQ(req.request_id(), "r1");
  EXPECT_EQ(req.q().data(), in->q.bytes());
  EXPECT_TRUE(req.options().causal());
  EXPECT_TRUE(req.options().has_window_left());
  EXPECT_EQ(req.options().window_left(), 2);
  EXPECT_FALSE(req.options().has_window_right());
  EXPECT_FALSE(req.options().has_softmax_scale());
  EXPECT_TRUE(req.options().return_lse());
  EXPECT_EQ(req.cu_seqlens_q_size(), 0);

  const std::string q_bytes = in->q.bytes();
  v1::ForwardRequest moved = MakeForwardRequest(std::move(*in));
  EXPECT_EQ(moved.q().data(), q_bytes);
}

TEST(StatusTest, GrpcStatusKeepsCodeAndMessage) {
  const absl::Status s =
      ToAbslStatus(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "q.shape[3]: expected x"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "q.shape[3]: expected x");
  EXPECT_TRUE(ToAbslStatus(grpc::Status::OK).ok());
  EXPECT_EQ(ToAbslStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "")).code(),
            absl::StatusCode::kUnavailable);
}

TEST(ClientCreateTest, RejectsBadOptions) {
  EXPECT_EQ(AttentionClient::Create("").status().code(), absl::StatusCode::kInvalidArgument);
  ClientOptions o;
  o.load_balancing_policy = "random";
  EXPECT_THAT(AttentionClient::Create("localhost:1", o).status().message(),
              HasSubstr("pick_first or round_robin"));
  o.load_balancing_policy = "round_robin";
  o.num_channels = 0;
  EXPECT_THAT(AttentionClient::Create("localhost:1", o).status().message(),
              HasSubstr("num_channels"));
  o.num_channels = 3;
  auto client = AttentionClient::Create("dns:///localhost:1", o);
  ASSERT_TRUE(client.ok());
  EXPECT_EQ((*client)->num_channels(), 3);
}

}  // namespace
}  // namespace attnserve
