// The bearer-tokens file parser and the Authenticator's answers, without a
// server (the wire tests are in security_test.cc).
#include "server/auth/token_file.h"

#include <fstream>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "server/auth/authenticator.h"

namespace attnserve {
namespace {

TEST(TokenFileTest, ParsesTokensTenantsAndQuotas) {
  absl::StatusOr<TokenTable> t = ParseTokenFile(
      "# comment\n\n  aaaaaaaaaaaaaaaa team-a bytes_in_flight=100 kv_pages=7 shm_regions=2\n"
      "bbbbbbbbbbbbbbbb\tteam-a bytes_in_flight=100 kv_pages=7 shm_regions=2\n"
      "cccccccccccccccc team.b_c-d\n");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->tokens.size(), 3u);
  EXPECT_EQ(t->tokens[0].tenant, "team-a");
  EXPECT_EQ(t->tokens[0].digest, DigestToken("aaaaaaaaaaaaaaaa"));
  EXPECT_EQ(t->quotas.at("team-a").bytes_in_flight, 100);
  EXPECT_EQ(t->quotas.at("team-a").kv_pages, 7);
  EXPECT_EQ(t->quotas.at("team-a").shm_regions, 2);
  EXPECT_EQ(t->quotas.at("team.b_c-d").kv_pages, 0);
}

TEST(TokenFileTest, ErrorsNameTheLineAndNeverEchoTheToken) {
  struct Case {
    const char* text;
    const char* expected;
  } cases[] = {
      {"\nshort-secret team\n", "line 2: token: expected 16 to 512"},
      {"aaaaaaaaaaaaaaaa\n", "line 1: expected '<token> <tenant>"},
      {"aaaaaaaaaaaaaaaa bad/tenant\n", "line 1: tenant: expected"},
      {"aaaaaaaaaaaaaaaa t kv_pages=-1\n", "expected a quota NAME=N"},
      {"aaaaaaaaaaaaaaaa t gpus=1\n", "'gpus': expected a quota of"},
      {"aaaaaaaaaaaaaaaa t\naaaaaaaaaaaaaaaa u\n", "line 2: token: the same token"},
      {"aaaaaaaaaaaaaaaa t kv_pages=1\nbbbbbbbbbbbbbbbb t\n", "line 2: tenant 't': quotas differ"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<TokenTable> t = ParseTokenFile(c.text);
    ASSERT_FALSE(t.ok()) << c.text;
    EXPECT_TRUE(absl::StrContains(t.status().message(), c.expected)) << t.status();
    EXPECT_FALSE(absl::StrContains(t.status().message(), "aaaaaaaa")) << t.status();
    EXPECT_FALSE(absl::StrContains(t.status().message(), "short-secret")) << t.status();
  }
}

TEST(AuthenticatorTest, BearerTokensMapToTenants) {
  const std::string path = ::testing::TempDir() + "/tokens_unit";
  std::ofstream(path) << "aaaaaaaaaaaaaaaa team-a\n";
  TenantDirectory tenants;
  absl::StatusOr<std::unique_ptr<Authenticator>> auth =
      Authenticator::Create(AuthOptions{path, absl::Seconds(10)}, &tenants);
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_EQ(*(*auth)->Authenticate("Bearer aaaaaaaaaaaaaaaa"), "team-a");
  EXPECT_EQ(*(*auth)->Authenticate("bearer  aaaaaaaaaaaaaaaa "), "team-a");
  for (const char* bad : {"", "aaaaaaaaaaaaaaaa", "Basic aaaaaaaaaaaaaaaa", "Bearer ",
                          "Bearer aaaaaaaaaaaaaaab", "Bearer aaaaaaaaaaaaaaaaa"}) {
    absl::StatusOr<std::string> t = (*auth)->Authenticate(bad);
    EXPECT_TRUE(absl::IsUnauthenticated(t.status())) << bad;
  }
  EXPECT_TRUE(
      absl::StrContains(tenants.RenderPrometheus(), "attnserve_unauthenticated_calls_total 6"));
  EXPECT_TRUE(absl::StrContains(tenants.RenderPrometheus(),
                                "attnserve_tenant_calls_total{tenant=\"team-a\"} 2"));
  std::ofstream(path) << "";
  EXPECT_FALSE(Authenticator::Create(AuthOptions{path, absl::Seconds(10)}, &tenants).ok());
}

TEST(TenantDirectoryTest, InFlightChargesAreGivenBack) {
  TenantDirectory tenants;
  tenants.SetQuotas({{"t", TenantQuotas{100, 0, 0}}});
  absl::StatusOr<InFlightCharge> first = tenants.ChargeInFlight("t", 60);
  ASSERT_TRUE(first.ok());
  absl::StatusOr<InFlightCharge> second = tenants.ChargeInFlight("t", 60);
  ASSERT_TRUE(absl::IsResourceExhausted(second.status()));
  EXPECT_TRUE(absl::StrContains(second.status().message(), "tenant 't' quota bytes_in_flight"));
  first->Release();
  EXPECT_TRUE(tenants.ChargeInFlight("t", 60).ok());           // released again at once
  EXPECT_TRUE(tenants.ChargeInFlight("other", 1 << 30).ok());  // no quota
}

}  // namespace
}  // namespace attnserve
