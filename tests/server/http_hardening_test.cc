// The HTTP ports against hostile clients: a deeply nested JSON body, a JSON
// body over its cap, idle and slow connections in front of a readiness probe,
// and a second server asking for ports the first one holds.
#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/server.h"

namespace attnserve {
namespace {

ServerOptions HttpOptions() {
  ServerOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  options.backend.kind = "cpu";
  options.backend.cpu_threads = 1;
  options.metrics_enabled = true;
  options.metrics_host = "127.0.0.1";
  options.metrics_port = 0;
  options.kserve.http_enabled = true;
  options.kserve.http_host = "127.0.0.1";
  options.kserve.http_port = 0;
  options.max_request_bytes = 1 << 20;  // JSON bodies: 64 KiB
  return options;
}

std::unique_ptr<AttnServer> StartServer(const ServerOptions& options) {
  absl::StatusOr<std::unique_ptr<AttnServer>> server = AttnServer::Create(options);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return nullptr;
  absl::Status started = (*server)->Start();
  EXPECT_TRUE(started.ok()) << started;
  return started.ok() ? *std::move(server) : nullptr;
}

// A TCP connection to 127.0.0.1:port, or -1.
int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

class HttpHardeningTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = StartServer(HttpOptions());
    ASSERT_NE(server_, nullptr);
    client_ = std::make_unique<httplib::Client>("127.0.0.1", server_->http_port());
    client_->set_read_timeout(60, 0);
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::ZeroDuration());
  }

  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<httplib::Client> client_;
};

TEST_F(HttpHardeningTest, DeeplyNestedJsonIsRefusedWithoutRecursing) {
  // 60k levels of nesting in `data` (120 KB, under the body cap only when the
  // cap is large): the server must refuse it, not overflow its stack.
  ServerOptions options = HttpOptions();
  options.max_request_bytes = 64 << 20;
  std::unique_ptr<AttnServer> big = StartServer(options);
  ASSERT_NE(big, nullptr);
  const std::string data = std::string(60000, '[') + "1" + std::string(60000, ']');
  const std::string body = absl::StrCat(
      R"({"inputs":[{"name":"q","datatype":"FP32","shape":[1,1,1,8],"data":)", data, "}]}");
  httplib::Client client("127.0.0.1", big->http_port());
  client.set_read_timeout(60, 0);
  httplib::Result res = client.Post("/v2/models/attention/infer", body, "application/json");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 400) << res->body;
  EXPECT_NE(res->body.find("nested deeper"), std::string::npos) << res->body;
  httplib::Result ready = client.Get("/v2/health/ready");
  ASSERT_TRUE(ready);
  EXPECT_EQ(ready->status, 200);

  // Within the depth limit but deeper than the tensor's rank: named.
  const std::string deep = std::string(10, '[') + "1" + std::string(10, ']');
  res = client.Post(
      "/v2/models/attention/infer",
      absl::StrCat(R"({"inputs":[{"name":"q","datatype":"FP32","shape":[1,1,1,8],"data":)", deep,
                   "}]}"),
      "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400) << res->body;
  EXPECT_NE(res->body.find("inputs['q'].data: nested deeper than the tensor's rank"),
            std::string::npos)
      << res->body;
  big->Shutdown(absl::ZeroDuration());
}

TEST_F(HttpHardeningTest, JsonBodyOverItsCapIsRefusedBeforeItIsRead) {
  // 256 KiB of JSON against a 64 KiB cap (max_request_bytes / 16): refused by
  // its Content-Length, although binary bodies of that size are accepted.
  std::string numbers;
  while (numbers.size() < (256 << 10)) numbers += "0.5,";
  numbers.pop_back();
  const std::string body = absl::StrCat(
      R"({"inputs":[{"name":"q","datatype":"FP32","shape":[1],"data":[)", numbers, "]}]}");
  httplib::Result res = client_->Post("/v2/models/attention/infer", body, "application/json");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 413) << res->body;
  EXPECT_NE(res->body.find("binary tensor extension"), std::string::npos) << res->body;

  // Refused on the headers alone: the body is never sent here, so an answer
  // proves the server did not wait to read it. JSON over its cap, then any
  // body over --max_request_bytes.
  for (const std::string& extra :
       {std::string(), std::string("Inference-Header-Content-Length: 2\r\n")}) {
    const int fd = Connect(server_->http_port());
    ASSERT_GE(fd, 0);
    const std::string head = absl::StrCat(
        "POST /v2/models/attention/infer HTTP/1.1\r\nHost: x\r\nContent-Type: "
        "application/json\r\n",
        extra, "Content-Length: ", extra.empty() ? (256 << 10) : (2 << 20), "\r\n\r\n");
    ASSERT_EQ(send(fd, head.data(), head.size(), MSG_NOSIGNAL), static_cast<ssize_t>(head.size()));
    timeval timeout{30, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    char buffer[4096];
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    close(fd);
    ASSERT_GT(n, 0);
    EXPECT_EQ(std::string(buffer, static_cast<size_t>(n)).substr(0, 12), "HTTP/1.1 413")
        << std::string(buffer, static_cast<size_t>(n));
  }
}

TEST_F(HttpHardeningTest, IdleAndSlowConnectionsDoNotStallProbes) {
  constexpr int kIdle = 64;
  constexpr int kSlow = 16;
  std::vector<int> fds;
  for (int port : {server_->http_port(), server_->metrics_port()}) {
    for (int i = 0; i < kIdle; ++i) {
      const int fd = Connect(port);
      ASSERT_GE(fd, 0);
      fds.push_back(fd);
    }
  }
  // Slow clients: a request line that never ends, a byte at a time.
  std::vector<int> slow;
  for (int i = 0; i < kSlow; ++i) {
    const int fd = Connect(server_->http_port());
    ASSERT_GE(fd, 0);
    slow.push_back(fd);
  }
  std::atomic<bool> stop{false};
  std::thread trickle;
  // Joined on every way out, a failed assertion included.
  struct Join {
    std::atomic<bool>* stop;
    std::thread* thread;
    ~Join() {
      stop->store(true);
      if (thread->joinable()) thread->join();
    }
  } join{&stop, &trickle};
  trickle = std::thread([&] {
    const std::string request = "GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nX-Slow: ";
    size_t sent = 0;
    while (!stop.load()) {
      const char c = sent < request.size() ? request[sent] : 'a';
      for (int fd : slow) (void)!send(fd, &c, 1, MSG_NOSIGNAL);
      ++sent;
      absl::SleepFor(absl::Milliseconds(200));
    }
  });

  // Generous for a loaded 2-core machine; a stalled pool takes tens of seconds.
  const absl::Duration bound = absl::Seconds(4);
  for (int port : {server_->http_port(), server_->metrics_port()}) {
    httplib::Client client("127.0.0.1", port);
    client.set_connection_timeout(10, 0);
    client.set_read_timeout(30, 0);
    const absl::Time begin = absl::Now();
    httplib::Result res =
        client.Get(port == server_->http_port() ? "/v2/health/ready" : "/metrics");
    const absl::Duration took = absl::Now() - begin;
    ASSERT_TRUE(res) << httplib::to_string(res.error());
    EXPECT_EQ(res->status, 200);
    EXPECT_LT(took, bound) << "port " << port << " answered after " << took;
  }
  for (int fd : fds) close(fd);
  for (int fd : slow) close(fd);
}

TEST(HttpPortsTest, SecondServerOnTheSamePortsRefusesToStart) {
  std::unique_ptr<AttnServer> first = StartServer(HttpOptions());
  ASSERT_NE(first, nullptr);
  for (const char* which : {"http", "metrics"}) {
    ServerOptions options = HttpOptions();
    if (std::string(which) == "http") {
      options.kserve.http_port = first->http_port();
    } else {
      options.metrics_port = first->metrics_port();
    }
    absl::StatusOr<std::unique_ptr<AttnServer>> second = AttnServer::Create(options);
    ASSERT_TRUE(second.ok()) << second.status();
    const absl::Status started = (*second)->Start();
    EXPECT_EQ(started.code(), absl::StatusCode::kUnavailable) << which << ": " << started;
    (*second)->Shutdown(absl::ZeroDuration());
  }
  first->Shutdown(absl::ZeroDuration());
}

}  // namespace
}  // namespace attnserve

namespace attnserve {
namespace {

// The value of a gauge without labels in /metrics' text, or -1.
double Gauge(const std::string& text, const std::string& name) {
  const std::string key = "\n" + name + "{} ";
  const size_t at = text.find(key);
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + key.size()));
}

// What HTTP calls hold is charged to the budget while they run and given
// back when they end, refused or served: /metrics shows the budget and, with
// no call running, nothing held.
TEST_F(HttpHardeningTest, BufferedBytesAreReleasedAndReported) {
  ServerOptions options = HttpOptions();
  options.max_buffered_bytes = int64_t{64} << 20;
  server_->Shutdown(absl::ZeroDuration());
  server_ = StartServer(options);
  ASSERT_NE(server_, nullptr);
  httplib::Client http("127.0.0.1", server_->http_port());
  const std::string q = R"({"name":"q","datatype":"FP32","shape":[1,2,1,8],"data":[)"
                        "1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8]}";
  const std::string body =
      absl::StrCat(R"({"inputs":[)", q, ",", absl::StrReplaceAll(q, {{"\"q\"", "\"k\""}}), ",",
                   absl::StrReplaceAll(q, {{"\"q\"", "\"v\""}}), "]}");
  for (int i = 0; i < 3; ++i) {
    httplib::Result served = http.Post("/v2/models/attention/infer", body, "application/json");
    ASSERT_TRUE(served);
    EXPECT_EQ(served->status, 200) << served->body;
  }
  httplib::Result refused =
      http.Post("/v2/models/attention/infer", "{\"inputs\": [", "application/json");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 400) << refused->body;
  httplib::Client metrics("127.0.0.1", server_->metrics_port());
  httplib::Result scrape = metrics.Get("/metrics");
  ASSERT_TRUE(scrape);
  EXPECT_EQ(Gauge(scrape->body, "attnserve_http_buffered_bytes"), 0) << scrape->body;
  // Half of --max_buffered_bytes bounds the HTTP side.
  EXPECT_EQ(Gauge(scrape->body, "attnserve_http_buffered_bytes_limit"), double(int64_t{32} << 20))
      << scrape->body;
}

// The gauge's value on a fresh scrape once `pred` holds for it, or the last
// value seen after 20 s.
template <typename Pred>
double GaugeOnceIt(int metrics_port, const std::string& name, Pred pred) {
  httplib::Client metrics("127.0.0.1", metrics_port);
  double value = -1;
  for (const absl::Time give_up = absl::Now() + absl::Seconds(20); absl::Now() < give_up;
       absl::SleepFor(absl::Milliseconds(20))) {
    httplib::Result scrape = metrics.Get("/metrics");
    if (scrape) value = Gauge(scrape->body, name);
    if (pred(value)) break;
  }
  return value;
}

// Finding 8: a body let through by its Content-Length is charged to the
// budget from then on, so bodies read at once cannot each count on the same
// free bytes (each was checked against the free bytes and none charged until
// read whole: any number of 20 MiB bodies were read against 32 MiB).
TEST_F(HttpHardeningTest, BodyIsChargedFromItsHeadersOn) {
  ServerOptions options = HttpOptions();
  options.max_buffered_bytes = int64_t{64} << 20;  // HTTP: 32 MiB
  options.max_request_bytes = int64_t{64} << 20;
  server_->Shutdown(absl::ZeroDuration());
  server_ = StartServer(options);
  ASSERT_NE(server_, nullptr);
  const std::string head =
      "POST /v2/models/attention/infer HTTP/1.1\r\nHost: x\r\n"
      "Inference-Header-Content-Length: 2\r\nContent-Length: 20971520\r\n\r\n";
  const int first = Connect(server_->http_port());
  ASSERT_GE(first, 0);
  ASSERT_EQ(send(first, head.data(), head.size(), MSG_NOSIGNAL), static_cast<ssize_t>(head.size()));
  const auto charged = [](double v) { return v == double(20 << 20); };
  EXPECT_TRUE(
      charged(GaugeOnceIt(server_->metrics_port(), "attnserve_http_buffered_bytes", charged)));

  // A second body of the same size no longer fits: refused on its headers.
  const int second = Connect(server_->http_port());
  ASSERT_GE(second, 0);
  ASSERT_EQ(send(second, head.data(), head.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(head.size()));
  timeval timeout{20, 0};
  setsockopt(second, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  // The whole answer: the server closes the connection after it.
  std::string answer;
  char buffer[4096];
  for (ssize_t n; (n = recv(second, buffer, sizeof(buffer), 0)) > 0;) {
    answer.append(buffer, static_cast<size_t>(n));
  }
  close(second);
  EXPECT_EQ(answer.substr(0, 12), "HTTP/1.1 413") << answer;
  EXPECT_NE(answer.find("--max_buffered_bytes"), std::string::npos) << answer;

  // The first client gives up: its charge is given back.
  close(first);
  const auto released = [](double v) { return v == 0; };
  EXPECT_TRUE(
      released(GaugeOnceIt(server_->metrics_port(), "attnserve_http_buffered_bytes", released)));
}

}  // namespace
}  // namespace attnserve
