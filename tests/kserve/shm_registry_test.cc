// ShmRegistry: bounds on every Acquire, regions kept mapped while a holder
// uses them after Unregister, tenants that cannot see each other's regions
// (answered exactly as unregistered names) nor name each other's objects,
// bounded names and registrations, objects shrunk by their client (refused,
// or absorbed mid-access without a crash), and the off switch.
#include "server/shm/shm_registry.h"

#include <signal.h>
#include <sys/wait.h>

#include <cstring>
#include <string>

#include "gtest/gtest.h"
#include "server/auth/tenants.h"
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

TEST(ShmRegistryTest, NamesAndKeysAreBounded) {
  TestShmObject object(4096, "names");
  ASSERT_TRUE(object.ok());
  ShmRegistry registry(true);
  const std::string long_name(kMaxShmNameBytes + 1, 'n');
  absl::Status s = registry.RegisterSystem("t", long_name, object.key(), 0, 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "name: expected at most 256 bytes, got 257");
  s = registry.RegisterSystem("t", "r", "/" + std::string(kMaxShmNameBytes, 'k'), 0, 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "key: expected at most 256 bytes, got 257");
  s = registry.RegisterCuda("t", long_name, std::string(64, '\0'), 0, 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "name: expected at most 256 bytes, got 257");
  EXPECT_TRUE(
      registry.RegisterSystem("t", std::string(kMaxShmNameBytes, 'n'), object.key(), 0, 64).ok());
  EXPECT_EQ(registry.List("t", ShmKind::kSystem, "")->size(), 1u);
}

TEST(ShmRegistryTest, RegistrationsAreBoundedPerTenantAndServerWide) {
  TestShmObject object(4096, "limits");
  ASSERT_TRUE(object.ok());
  ShmLimits limits;
  limits.max_regions = 3;
  limits.max_regions_per_tenant = 2;
  ShmRegistry registry(true, limits);
  ASSERT_TRUE(registry.RegisterSystem("a", "r1", object.key(), 0, 64).ok());
  ASSERT_TRUE(registry.RegisterSystem("a", "r2", object.key(), 0, 64).ok());
  absl::Status s = registry.RegisterSystem("a", "r3", object.key(), 0, 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("--max_shm_regions_per_tenant"), std::string::npos) << s;
  EXPECT_NE(s.message().find("'r3'"), std::string::npos) << s;
  ASSERT_TRUE(registry.RegisterSystem("b", "r1", object.key(), 0, 64).ok());
  s = registry.RegisterSystem("b", "r2", object.key(), 0, 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("(--max_shm_regions)"), std::string::npos) << s;
  // Unregistering makes room again.
  ASSERT_TRUE(registry.Unregister("a", ShmKind::kSystem, "").ok());
  EXPECT_TRUE(registry.RegisterSystem("b", "r2", object.key(), 0, 64).ok());
  EXPECT_TRUE(registry.RegisterSystem("a", "r1", object.key(), 0, 64).ok());
  EXPECT_EQ(registry.RegisterSystem("a", "r2", object.key(), 0, 64).code(),
            absl::StatusCode::kResourceExhausted);
}

// With authentication on, a tenant names only keys under its own prefix, and
// only objects that are the server user's and private to it; the server's
// own rights never open another tenant's memory for it.
TEST(ShmRegistryTest, WithAuthenticationATenantRegistersOnlyItsOwnKeys) {
  TestShmObject a_object(4096, "own", ShmKeyPrefix("a"));
  ASSERT_TRUE(a_object.ok());
  TenantDirectory tenants;
  ShmRegistry registry(true);
  registry.set_tenants(&tenants);
  absl::Status s = registry.RegisterSystem("b", "stolen", a_object.key(), 0, 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("may register only keys that start with '/attnserve.b.'"),
            std::string::npos)
      << s;
  EXPECT_TRUE(registry.List("b", ShmKind::kSystem, "")->empty());
  EXPECT_TRUE(registry.RegisterSystem("a", "mine", a_object.key(), 0, 64).ok());
  // The bare prefix, and keys of the old unprefixed form, are nobody's.
  EXPECT_EQ(registry.RegisterSystem("a", "bare", ShmKeyPrefix("a"), 0, 64).code(),
            absl::StatusCode::kPermissionDenied);
  TestShmObject plain(4096, "plain");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(registry.RegisterSystem("a", "plain", plain.key(), 0, 64).code(),
            absl::StatusCode::kPermissionDenied);
  // A tenant whose name could not form its own key owns none.
  EXPECT_EQ(registry.RegisterSystem("(token withdrawn)", "w", a_object.key(), 0, 64).code(),
            absl::StatusCode::kPermissionDenied);

  // Writable by group or others: someone else may change it under the tenant.
  TestShmObject shared(4096, "shared", ShmKeyPrefix("a"), 0660);
  ASSERT_TRUE(shared.ok());
  s = registry.RegisterSystem("a", "shared", shared.key(), 0, 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("mode 0660"), std::string::npos) << s;
  // A second link: a name under a's prefix for an object made under another.
  TestShmObject linked(4096, "linked", ShmKeyPrefix("b"));
  ASSERT_TRUE(linked.ok());
  const std::string alias = ShmKeyPrefix("a") + "alias_" + std::to_string(getpid());
  ASSERT_EQ(link(("/dev/shm" + linked.key()).c_str(), ("/dev/shm" + alias).c_str()), 0);
  s = registry.RegisterSystem("a", "alias", alias, 0, 64);
  shm_unlink(alias.c_str());
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("2 links"), std::string::npos) << s;
  EXPECT_EQ(registry.List("a", ShmKind::kSystem, "")->size(), 1u);

  // CUDA IPC handles name no owner: refused for every tenant.
  s = registry.RegisterCuda("a", "c", std::string(64, '\0'), 0, 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("authentication"), std::string::npos) << s;
}

TEST(ShmRegistryTest, WithoutAuthenticationAnyKeyIsTheOneTenants) {
  TestShmObject object(4096, "anykey", "/some.other.name_", 0660);
  ASSERT_TRUE(object.ok());
  ShmRegistry registry(true);
  EXPECT_TRUE(registry.RegisterSystem("default", "r", object.key(), 0, 64).ok());
}

TEST(ShmRegistryTest, AnObjectShrunkBeforeUseIsRefusedNamingTheRegion) {
  TestShmObject object(8192, "shrunk");
  ASSERT_TRUE(object.ok());
  ShmRegistry registry(true);
  ASSERT_TRUE(registry.RegisterSystem("t", "r", object.key(), 0, 8192).ok());
  ASSERT_TRUE(object.Truncate(100));
  absl::StatusOr<std::shared_ptr<ShmRegion>> r = registry.Acquire("t", "r", 0, 8);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("'r'"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("is now 100 bytes"), std::string::npos) << r.status();
  // Grown back, it is usable again: nothing of it was replaced.
  ASSERT_TRUE(object.Truncate(8192));
  EXPECT_TRUE(registry.Acquire("t", "r", 0, 8).ok());
}

// The object shrinks after the region was acquired (a request holds it):
// reads and writes past the new end complete instead of killing the process,
// and the region reports itself broken from then on.
TEST(ShmRegistryTest, AnObjectShrunkDuringUseBreaksTheRegionNotTheProcess) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  TestShmObject object(4 * page, "midway");
  ASSERT_TRUE(object.ok());
  ShmRegistry registry(true);
  ASSERT_TRUE(registry.RegisterSystem("t", "r", object.key(), 0, 4 * page).ok());
  ASSERT_TRUE(registry.RegisterSystem("t", "other", object.key(), 0, page).ok());
  absl::StatusOr<std::shared_ptr<ShmRegion>> held = registry.Acquire("t", "r", 0, 4 * page);
  ASSERT_TRUE(held.ok());
  ASSERT_TRUE(object.Truncate(page));

  char* mapped = (*held)->mapped();
  mapped[3 * page] = 'x';  // in place, as a backend writes an output
  EXPECT_EQ(mapped[3 * page + 1], 0);
  std::string read(page, 'y');
  absl::Status s = (*held)->Read(2 * page, page, read.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("'r'"), std::string::npos) << s;
  EXPECT_NE(s.message().find("shrank"), std::string::npos) << s;
  EXPECT_EQ((*held)->Write(3 * page, "z", 1).code(), absl::StatusCode::kFailedPrecondition);
  // Still broken once the object has its size back: the server's pages past
  // the old end are zeros of its own, not the client's memory.
  ASSERT_TRUE(object.Truncate(4 * page));
  EXPECT_EQ((*held)->CheckIntact().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(registry.Acquire("t", "r", 0, 8).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // The first page was never past the end, and another region of the same
  // object is untouched.
  EXPECT_TRUE(registry.Acquire("t", "other", 0, page).ok());
  // Re-registering maps the object afresh.
  ASSERT_TRUE(registry.Unregister("t", ShmKind::kSystem, "r").ok());
  held->reset();
  ASSERT_TRUE(registry.RegisterSystem("t", "r", object.key(), 0, 4 * page).ok());
  EXPECT_TRUE(registry.Acquire("t", "r", 0, 4 * page).ok());
}

// Killed by SIGBUS, or exited by the handler that was there before the
// guard's (a sanitizer's reports and exits).
bool DiedOfBusError(int status) {
  return (WIFSIGNALED(status) && WTERMSIG(status) == SIGBUS) ||
         (WIFEXITED(status) && WEXITSTATUS(status) != 0);
}

// The guard takes only faults inside registered mappings: any other SIGBUS
// is as fatal as it was without it.
TEST(ShmRegistryDeathTest, OtherBusErrorsStillKill) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  TestShmObject registered(4096, "guardon");
  ASSERT_TRUE(registered.ok());
  ShmRegistry registry(true);
  ASSERT_TRUE(registry.RegisterSystem("t", "r", registered.key(), 0, 64).ok());
  TestShmObject unguarded(8192, "unguarded");
  ASSERT_TRUE(unguarded.ok());
  EXPECT_EXIT(
      {
        unguarded.Truncate(0);
        volatile char c = unguarded.data()[4096];
        (void)c;
      },
      DiedOfBusError, "");
  EXPECT_EXIT(raise(SIGBUS), DiedOfBusError, "");
}

}  // namespace
}  // namespace attnserve
