// ShmRegistry: bounds on every Acquire, regions kept mapped while a holder
// uses them after Unregister, tenants that cannot see each other's regions
// (answered exactly as unregistered names), and the off switch.
#include "server/kserve/shm_registry.h"

#include <cstring>
#include <string>

#include "gtest/gtest.h"
#include "tests/kserve/shm_test_util.h"

namespace attnserve {
namespace {

TEST(ShmRegistryTest, AcquireChecksBoundsAndNamesTheRegion) {
  TestShmObject object(4096, "bounds");
  ASSERT_TRUE(object.ok());
  ShmRegistry registry(/*allowed=*/true);
  ASSERT_TRUE(registry.RegisterSystem("t", "r", object.key(), 1024, 256).ok());
  EXPECT_TRUE(registry.Acquire("t", "r", 0, 256).ok());
  EXPECT_TRUE(registry.Acquire("t", "r", 255, 1).ok());
  for (auto [offset, size] :
       {std::pair<uint64_t, uint64_t>{0, 257}, {256, 1}, {300, 0}, {1, UINT64_MAX}}) {
    absl::StatusOr<std::shared_ptr<ShmRegion>> r = registry.Acquire("t", "r", offset, size);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("'r'"), std::string::npos) << r.status();
  }
  absl::StatusOr<std::shared_ptr<ShmRegion>> missing = registry.Acquire("t", "nope", 0, 1);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("'nope'"), std::string::npos);
}

TEST(ShmRegistryTest, RegisterRefusesRegionsPastTheObjectAndDuplicates) {
  TestShmObject object(4096, "register");
  ASSERT_TRUE(object.ok());
  ShmRegistry registry(true);
  absl::Status past = registry.RegisterSystem("t", "big", object.key(), 4000, 200);
  EXPECT_EQ(past.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(past.message().find("'big'"), std::string::npos) << past;
  absl::Status no_key = registry.RegisterSystem("t", "k", "/attnserve_no_such_object", 0, 8);
  EXPECT_EQ(no_key.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.RegisterSystem("t", "zero", object.key(), 0, 0).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(registry.RegisterSystem("t", "r", object.key(), 0, 64).ok());
  EXPECT_EQ(registry.RegisterSystem("t", "r", object.key(), 0, 64).code(),
            absl::StatusCode::kAlreadyExists);
  // A failed call changed nothing.
  absl::StatusOr<std::vector<ShmRegionInfo>> all = registry.List("t", ShmKind::kSystem, "");
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 1u);
  EXPECT_EQ((*all)[0].name, "r");
  EXPECT_EQ((*all)[0].byte_size, 64u);
}

TEST(ShmRegistryTest, UnregisteredRegionStaysMappedForItsHolder) {
  TestShmObject object(4096, "held");
  ASSERT_TRUE(object.ok());
  std::memcpy(object.data() + 100, "attention", 9);
  ShmRegistry registry(true);
  ASSERT_TRUE(registry.RegisterSystem("t", "r", object.key(), 100, 64).ok());
  absl::StatusOr<std::shared_ptr<ShmRegion>> held = registry.Acquire("t", "r", 0, 9);
  ASSERT_TRUE(held.ok());
  ASSERT_TRUE(registry.Unregister("t", ShmKind::kSystem, "r").ok());
  EXPECT_EQ(registry.Acquire("t", "r", 0, 9).status().code(), absl::StatusCode::kInvalidArgument);
  // The running request still reads and writes the mapping.
  char read[9];
  ASSERT_TRUE((*held)->Read(0, 9, read).ok());
  EXPECT_EQ(std::string(read, 9), "attention");
  ASSERT_TRUE((*held)->Write(0, "ATTENTION", 9).ok());
  EXPECT_EQ(std::string(object.data() + 100, 9), "ATTENTION");
}

// What requests read and write in place: the region's bytes from its
// registered offset, the client's own memory, mapped while a holder keeps it.
TEST(ShmRegistryTest, MappedBytesStartAtTheRegisteredOffset) {
  TestShmObject object(4096, "mapped");
  ASSERT_TRUE(object.ok());
  std::memcpy(object.data() + 100, "attention", 9);
  ShmRegistry registry(true);
  ASSERT_TRUE(registry.RegisterSystem("t", "r", object.key(), 100, 64).ok());
  absl::StatusOr<std::shared_ptr<ShmRegion>> held = registry.Acquire("t", "r", 0, 64);
  ASSERT_TRUE(held.ok());
  ASSERT_TRUE(registry.Unregister("t", ShmKind::kSystem, "r").ok());
  char* mapped = (*held)->mapped();
  ASSERT_NE(mapped, nullptr);
  EXPECT_EQ(std::string(mapped, 9), "attention");
  std::memcpy(mapped + 9, "SERVE", 5);
  EXPECT_EQ(std::string(object.data() + 109, 5), "SERVE");
}

TEST(ShmRegistryTest, AnotherTenantsRegionLooksUnregistered) {
  TestShmObject object(4096, "tenants");
  ASSERT_TRUE(object.ok());
  ShmRegistry registry(true);
  const absl::Status acquire_before = registry.Acquire("b", "r", 0, 8).status();
  const absl::Status list_before = registry.List("b", ShmKind::kSystem, "r").status();
  ASSERT_TRUE(registry.RegisterSystem("a", "r", object.key(), 0, 64).ok());
  EXPECT_EQ(registry.Acquire("b", "r", 0, 8).status(), acquire_before);
  EXPECT_EQ(registry.List("b", ShmKind::kSystem, "r").status(), list_before);
  absl::StatusOr<std::vector<ShmRegionInfo>> b_all = registry.List("b", ShmKind::kSystem, "");
  ASSERT_TRUE(b_all.ok());
  EXPECT_TRUE(b_all->empty());
  // b's unregister of "r" leaves a's alone; b may register its own "r".
  ASSERT_TRUE(registry.Unregister("b", ShmKind::kSystem, "").ok());
  EXPECT_TRUE(registry.Acquire("a", "r", 0, 8).ok());
  EXPECT_TRUE(registry.RegisterSystem("b", "r", object.key(), 64, 64).ok());
  EXPECT_EQ(registry.List("a", ShmKind::kSystem, "")->size(), 1u);
}

TEST(ShmRegistryTest, OffWithoutTheFlag) {
  TestShmObject object(4096, "off");
  ASSERT_TRUE(object.ok());
  ShmRegistry registry(/*allowed=*/false);
  for (const absl::Status& s : {registry.RegisterSystem("t", "r", object.key(), 0, 64),
                                registry.Acquire("t", "r", 0, 1).status(),
                                registry.List("t", ShmKind::kSystem, "").status(),
                                registry.Unregister("t", ShmKind::kSystem, "")}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(s.message().find("--allow_client_shm"), std::string::npos) << s;
  }
}

TEST(ShmRegistryTest, CudaRegionsNeedACudaBuild) {
  ShmRegistry registry(true);
  const absl::Status s = registry.RegisterCuda("t", "c", std::string(64, '\0'), 0, 64);
#if ATTNSERVE_HAVE_CUDA
  // No GPU here (FAILED_PRECONDITION), or a zero handle, which is no
  // allocation of another process.
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'c'"), std::string::npos) << s;
#else
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
#endif
  EXPECT_TRUE(registry.List("t", ShmKind::kCuda, "")->empty());
}

}  // namespace
}  // namespace attnserve
