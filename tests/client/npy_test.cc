// .npy reading and writing: round trips of every dtype and shape kind, the
// header details NumPy relies on, and a clear error for each unsupported or
// malformed file.
#include "client/npy.h"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

// A .npy file with the given version and header text, padded as NumPy does.
std::string MakeFile(int major, const std::string& dict, const std::string& data) {
  const size_t len_bytes = major == 1 ? 2 : 4;
  std::string header = dict;
  const size_t unpadded = 8 + len_bytes + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::string file("\x93NUMPY", 6);
  file.push_back(static_cast<char>(major));
  file.push_back(0);
  for (size_t i = 0; i < len_bytes; ++i)
    file.push_back(static_cast<char>(header.size() >> (8 * i)));
  return file + header + data;
}

std::string FloatBytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

std::vector<float> Iota(int n) {
  std::vector<float> v(n);
  for (int i = 0; i < n; ++i) v[i] = 0.25f * (i + 1) * (i % 2 ? -1.0f : 1.0f);
  return v;
}

TEST(NpyTest, RoundTripsFp16AndFp32Exactly) {
  for (DType dtype : {DType::kFP16, DType::kFP32}) {
    auto t = HostTensor::FromFloats(dtype, {2, 3, 4}, Iota(24));
    ASSERT_TRUE(t.ok());
    const std::string file = EncodeNpy(*t);
    auto back = ParseNpy(file, "mem");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->dtype(), dtype);
    EXPECT_EQ(back->shape(), (std::vector<int64_t>{2, 3, 4}));
    EXPECT_EQ(back->bytes(), t->bytes());
  }
}

TEST(NpyTest, Bf16IsWrittenAsFloat32AndConvertsBackBitExact) {
  auto t = HostTensor::FromFloats(DType::kBF16, {5}, {1.0f, -3.14159f, 1e-3f, 65504.f, 0.1f});
  ASSERT_TRUE(t.ok());
  const std::string file = EncodeNpy(*t);
  EXPECT_THAT(file, HasSubstr("'descr': '<f4'"));
  auto back = ParseNpy(file, "mem");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->dtype(), DType::kFP32);
  EXPECT_EQ(back->ConvertTo(DType::kBF16).bytes(), t->bytes());
}

TEST(NpyTest, HeaderIsNumpyCompatible) {
  auto t = HostTensor::FromFloats(DType::kFP32, {7}, Iota(7));
  const std::string file = EncodeNpy(*t);
  EXPECT_EQ(file.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  const size_t header_len =
      static_cast<unsigned char>(file[8]) | (static_cast<unsigned char>(file[9]) << 8);
  const size_t data_at = 10 + header_len;
  EXPECT_EQ(data_at % 64, 0u);
  EXPECT_EQ(file[data_at - 1], '\n');
  // A one-element tuple needs its trailing comma to be a tuple in Python.
  EXPECT_THAT(file, HasSubstr("'shape': (7,)"));
  EXPECT_EQ(file.size(), data_at + 7 * 4);
}

TEST(NpyTest, ScalarAndEmptyShapes) {
  auto scalar = ParseNpy(
      MakeFile(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (), }", FloatBytes({2.5f})),
      "scalar");
  ASSERT_TRUE(scalar.ok()) << scalar.status();
  EXPECT_TRUE(scalar->shape().empty());
  EXPECT_EQ(scalar->ToFloats(), std::vector<float>{2.5f});

  auto empty = HostTensor::FromFloats(DType::kFP16, {0, 3, 8}, {});
  ASSERT_TRUE(empty.ok());
  auto back = ParseNpy(EncodeNpy(*empty), "empty");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->shape(), (std::vector<int64_t>{0, 3, 8}));
  EXPECT_EQ(back->num_elements(), 0);
}

TEST(NpyTest, ReadsVersion2And3KeyOrderAndDoubleQuotes) {
  for (int major : {2, 3}) {
    auto t = ParseNpy(MakeFile(major,
                               "{\"shape\": (2, 1), \"fortran_order\": False, "
                               "\"descr\": \"<f4\"}",
                               FloatBytes({1.f, 2.f})),
                      "v2");
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->shape(), (std::vector<int64_t>{2, 1}));
    EXPECT_EQ(t->ToFloats(), (std::vector<float>{1.f, 2.f}));
  }
}

TEST(NpyTest, ReadsFloat64NarrowedAndUint16AsBf16Bits) {
  const double d[3] = {0.5, -1.25, 3.0};
  auto f8 = ParseNpy(MakeFile(1, "{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }",
                              std::string(reinterpret_cast<const char*>(d), sizeof(d))),
                     "f8");
  ASSERT_TRUE(f8.ok()) << f8.status();
  EXPECT_EQ(f8->dtype(), DType::kFP32);
  EXPECT_EQ(f8->ToFloats(), (std::vector<float>{0.5f, -1.25f, 3.0f}));

  const uint16_t bits[2] = {FloatToBf16(1.5f), FloatToBf16(-2.0f)};
  auto u2 = ParseNpy(MakeFile(1, "{'descr': '<u2', 'fortran_order': False, 'shape': (2,), }",
                              std::string(reinterpret_cast<const char*>(bits), sizeof(bits))),
                     "u2");
  ASSERT_TRUE(u2.ok()) << u2.status();
  EXPECT_EQ(u2->dtype(), DType::kBF16);
  EXPECT_EQ(u2->ToFloats(), (std::vector<float>{1.5f, -2.0f}));
}

// NumPy has no float8: a uint8 array ('|u1', '<u1', or the void '|V1' some
// float8 libraries write) holds FP8 E4M3 codes, read byte for byte.
TEST(NpyTest, ReadsUint8AsFp8Codes) {
  const std::string codes("\x38\xc2\x7e\x01", 4);  // 1, -2.5, 448, 2^-9
  for (const char* descr : {"|u1", "<u1", "|V1"}) {
    SCOPED_TRACE(descr);
    auto t = ParseNpy(
        MakeFile(
            1, absl::StrCat("{'descr': '", descr, "', 'fortran_order': False, 'shape': (2, 2), }"),
            codes),
        "fp8");
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->dtype(), DType::kFP8E4M3);
    EXPECT_EQ(t->bytes(), codes);
    EXPECT_EQ(t->ToFloats(), (std::vector<float>{1.0f, -2.5f, 448.0f, 0.001953125f}));
  }
  // Written back as '|u1' codes.
  auto t = HostTensor::FromBytes(DType::kFP8E4M3, {4}, codes);
  ASSERT_TRUE(t.ok());
  const std::string file = EncodeNpy(*t);
  EXPECT_NE(file.find("'descr': '|u1'"), std::string::npos);
  auto back = ParseNpy(file, "back");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->dtype(), DType::kFP8E4M3);
  EXPECT_EQ(back->bytes(), codes);
  // A length that does not match the shape is still refused.
  auto short_file = ParseNpy(
      MakeFile(1, "{'descr': '|u1', 'fortran_order': False, 'shape': (5,), }", codes), "short");
  EXPECT_FALSE(short_file.ok());
}

TEST(NpyTest, FileRoundTripAndMissingFile) {
  const std::string path = ::testing::TempDir() + "/npy_test_roundtrip.npy";
  auto t = HostTensor::FromFloats(DType::kFP16, {3, 2}, Iota(6));
  ASSERT_TRUE(WriteNpy(path, *t).ok());
  auto back = ReadNpy(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->bytes(), t->bytes());
  std::remove(path.c_str());

  auto missing = ReadNpy(path);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr(path));
  EXPECT_FALSE(WriteNpy("/nonexistent-dir/x.npy", *t).ok());
}

struct Malformed {
  const char* name;
  std::string contents;
  const char* expected;  // a substring of the error
};

TEST(NpyTest, RejectsMalformedAndUnsupportedFiles) {
  const std::string two_floats = FloatBytes({1.f, 2.f});
  const std::vector<Malformed> cases = {
      {"empty", "", "not a .npy file"},
      {"text", "hello world, not numpy", "not a .npy file"},
      {"version", std::string("\x93NUMPY\x04\x00\x10\x00", 10), "unsupported .npy version 4.0"},
      {"truncated_header", std::string("\x93NUMPY\x01\x00\xff\x00{'descr'", 17),
       "file ends before"},
      {"fortran",
       MakeFile(1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2,), }", two_floats),
       "Fortran-order"},
      {"big_endian",
       MakeFile(1, "{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", two_floats),
       "big-endian"},
      {"int32",
       MakeFile(1, "{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }", two_floats),
       "element type '<i4' is not supported"},
      {"short_data",
       MakeFile(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", two_floats),
       "needs 3 * 4 bytes of data, the file has 8"},
      {"long_data",
       MakeFile(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", two_floats),
       "needs 1 * 4 bytes"},
      {"missing_key", MakeFile(1, "{'descr': '<f4', 'shape': (2,), }", two_floats),
       "must have 'descr', 'fortran_order' and 'shape'"},
      {"bad_shape",
       MakeFile(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (a,), }", two_floats),
       "non-negative integers"},
      {"extra_key",
       MakeFile(1,
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), "
                "'x': 1}",
                two_floats),
       "unexpected key 'x'"},
      {"no_brace", MakeFile(1, "'descr': '<f4'", two_floats), "expected '{'"},
  };
  for (const Malformed& c : cases) {
    auto t = ParseNpy(c.contents, c.name);
    ASSERT_FALSE(t.ok()) << c.name;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(t.status().message(), HasSubstr(c.expected)) << c.name;
    EXPECT_THAT(t.status().message(), HasSubstr(c.name)) << "error must name the file";
  }
}

}  // namespace
}  // namespace attnserve
