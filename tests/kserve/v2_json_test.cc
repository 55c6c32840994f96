// The KServe v2 HTTP infer body's parsing (server/kserve/v2_json.h) on
// inputs http_json_fuzzer found or that sit at its limits.
#include "server/kserve/v2_json.h"

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

absl::Status Parse(const std::string& body, inference::ModelInferRequest* request,
                   std::optional<absl::string_view> header_length = std::nullopt) {
  OutputForm form;
  return ParseInferBody(body, header_length, request, &form);
}

std::string Int32Body(const std::string& number) {
  return absl::StrCat(R"({"inputs":[{"name":"i","datatype":"INT32","shape":[1],"data":[)", number,
                      "]}]}");
}

// Found by http_json_fuzzer under UBSan: a number outside int32's range was
// converted to int32 before being compared, which is undefined behaviour.
// Its input is corpus/http_json_fuzzer/regression_int32_out_of_range.bin.
TEST(V2JsonTest, Int32DataOutOfRangeIsRefused) {
  for (const char* number :
       {"3e92", "2147483648", "-2147483649", "1e300", "-1e300", "4294967296"}) {
    inference::ModelInferRequest request;
    const absl::Status s = Parse(Int32Body(number), &request);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << number;
    EXPECT_NE(s.message().find("inputs['i'].data[0]: expected an INT32"), absl::string_view::npos)
        << s.message();
  }
}

TEST(V2JsonTest, Int32DataAtTheLimitsIsPacked) {
  for (const int32_t value : {INT32_MIN, INT32_MAX, 0, -1}) {
    inference::ModelInferRequest request;
    ASSERT_TRUE(Parse(Int32Body(absl::StrCat(value)), &request).ok()) << value;
    ASSERT_EQ(request.raw_input_contents_size(), 1);
    ASSERT_EQ(request.raw_input_contents(0).size(), 4u);
    int32_t got;
    std::memcpy(&got, request.raw_input_contents(0).data(), 4);
    EXPECT_EQ(got, value);
  }
}

TEST(V2JsonTest, Int32DataMustBeWhole) {
  inference::ModelInferRequest request;
  EXPECT_EQ(Parse(Int32Body("1.5"), &request).code(), absl::StatusCode::kInvalidArgument);
}

TEST(V2JsonTest, NestingDeeperThanTheLimitIsRefused) {
  inference::ModelInferRequest request;
  const absl::Status s = Parse(std::string(1 << 20, '['), &request);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("nested deeper than"), absl::string_view::npos) << s.message();
}

TEST(V2JsonTest, BinaryDataIsSlicedFromTheBody) {
  const std::string header =
      R"({"inputs":[{"name":"q","datatype":"FP16","shape":[2],"parameters":{"binary_data_size":4}}]})";
  inference::ModelInferRequest request;
  const std::string length = absl::StrCat(header.size());
  ASSERT_TRUE(Parse(header + "abcd", &request, length).ok());
  ASSERT_EQ(request.raw_input_contents_size(), 1);
  EXPECT_EQ(request.raw_input_contents(0), "abcd");
  EXPECT_EQ(request.inputs(0).parameters().count("binary_data_size"), 0u);
}

}  // namespace
}  // namespace attnserve
