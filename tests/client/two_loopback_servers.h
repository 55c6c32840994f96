// A test suite base with two in-process CPU servers and a client for each,
// started once per suite: for tests that move or split data between servers.
#pragma once

#include "client/attention_client.h"
#include "gtest/gtest.h"
#include "tests/client/loopback_server.h"

namespace attnserve {

class TwoLoopbackServersTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    for (int i = 0; i < 2; ++i) {
      auto server = LoopbackServer::Start();
      ASSERT_TRUE(server.ok()) << server.status();
      servers_[i] = server->release();
      auto client = AttentionClient::Create(servers_[i]->target());
      ASSERT_TRUE(client.ok()) << client.status();
      clients_[i] = client->release();
    }
  }
  static void TearDownTestSuite() {
    for (int i = 0; i < 2; ++i) {
      delete clients_[i];
      delete servers_[i];
      clients_[i] = nullptr;
      servers_[i] = nullptr;
    }
  }
  void SetUp() override { ASSERT_NE(clients_[1], nullptr); }

  inline static LoopbackServer* servers_[2] = {nullptr, nullptr};
  inline static AttentionClient* clients_[2] = {nullptr, nullptr};
};

}  // namespace attnserve
