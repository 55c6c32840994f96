// Faults a client can cause, on a real AttnServer on
// 127.0.0.1:0 with the CPU backend:
//   - a client that disconnects mid-upload (HTTP/2 written by hand on a raw
//     socket: the request's first 16 KB of a declared 1 MB message, then
//     close) and one that disconnects mid-response (it advertises a 1-byte
//     flow-control window, so the server's answer stalls after its first
//     byte; the client closes when the response headers arrive);
//   - a cancellation storm: 2,000 calls cancelled at random points in flight.
// After each, the server must hold no more file descriptors than before,
// answer correctly, and do so within a second.
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "backend/backend_factory.h"
#include "client/attention_client.h"
#include "client/inputs.h"
#include "client/verify.h"
#include "gtest/gtest.h"
#include "server/server.h"
#include "spdlog/spdlog.h"

namespace attnserve {
namespace {

// Open file descriptors of this process (the server lives here).
int OpenFds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  while (readdir(d) != nullptr) ++n;
  closedir(d);
  return n - 3;  // ".", ".." and the DIR's own descriptor
}

// Polls `condition` every 10 ms for up to `timeout`.
template <typename F>
bool WaitFor(F condition, absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() > end) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

// ---- a minimal HTTP/2 client, enough to leave a call half done ----

std::string Frame(uint8_t type, uint8_t flags, uint32_t stream, const std::string& payload) {
  std::string f;
  const uint32_t n = static_cast<uint32_t>(payload.size());
  f += static_cast<char>(n >> 16);
  f += static_cast<char>(n >> 8);
  f += static_cast<char>(n);
  f += static_cast<char>(type);
  f += static_cast<char>(flags);
  for (int shift = 24; shift >= 0; shift -= 8) f += static_cast<char>(stream >> shift);
  return f + payload;
}
constexpr uint8_t kData = 0x0, kHeaders = 0x1, kSettings = 0x4;
constexpr uint8_t kEndStream = 0x1, kEndHeaders = 0x4;

// HPACK "literal header field without indexing, new name" (RFC 7541 6.2.2);
// every name and value here is under 127 bytes.
std::string Header(const std::string& name, const std::string& value) {
  return std::string(1, '\0') + static_cast<char>(name.size()) + name +
         static_cast<char>(value.size()) + value;
}

class RawHttp2 {
 public:
  // Connects and sends the preface and SETTINGS (with `initial_window` as
  // SETTINGS_INITIAL_WINDOW_SIZE when > 0); waits for the server's SETTINGS.
  RawHttp2(int port, uint32_t initial_window) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ok_ = fd_ >= 0 && connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    std::string settings;
    if (initial_window > 0) {
      settings += std::string("\0\x04", 2);  // SETTINGS_INITIAL_WINDOW_SIZE
      for (int shift = 24; shift >= 0; shift -= 8)
        settings += static_cast<char>(initial_window >> shift);
    }
    ok_ = ok_ && Send("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + Frame(kSettings, 0, 0, settings));
    ok_ = ok_ && ReadUntilFrame(kSettings, 0);
  }
  ~RawHttp2() {
    if (fd_ >= 0) close(fd_);
  }
  bool ok() const { return ok_; }

  bool Send(const std::string& bytes) {
    size_t sent = 0;
    while (sent < bytes.size()) {
      const ssize_t n = send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += size_t(n);
    }
    return true;
  }
  bool SendCallHeaders(uint32_t stream, const std::string& method) {
    const std::string block = Header(":method", "POST") + Header(":scheme", "http") +
                              Header(":path", method) + Header(":authority", "localhost") +
                              Header("content-type", "application/grpc") + Header("te", "trailers");
    return Send(Frame(kHeaders, kEndHeaders, stream, block));
  }
  // Reads frames until one of `type` on `stream` arrives (true) or the
  // connection ends or 10 s pass (false).
  bool ReadUntilFrame(uint8_t type, uint32_t stream) {
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (absl::Now() < end) {
      while (buffer_.size() >= 9) {
        const uint32_t len =
            (uint8_t(buffer_[0]) << 16) | (uint8_t(buffer_[1]) << 8) | uint8_t(buffer_[2]);
        if (buffer_.size() < 9 + len) break;
        const uint8_t t = uint8_t(buffer_[3]);
        const uint32_t s = ((uint8_t(buffer_[5]) & 0x7f) << 24) | (uint8_t(buffer_[6]) << 16) |
                           (uint8_t(buffer_[7]) << 8) | uint8_t(buffer_[8]);
        buffer_.erase(0, 9 + len);
        if (t == type && s == stream) return true;
      }
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      char chunk[16384];
      const ssize_t n = recv(fd_, chunk, sizeof(chunk), 0);
      if (n <= 0) return false;
      buffer_.append(chunk, size_t(n));
    }
    return false;
  }

 private:
  int fd_ = -1;
  bool ok_ = false;
  std::string buffer_;
};

// A gRPC message: the 5-byte prefix (uncompressed, big-endian length) and the bytes.
std::string GrpcMessage(const std::string& payload, uint32_t declared) {
  std::string m(1, '\0');
  for (int shift = 24; shift >= 0; shift -= 8) m += static_cast<char>(declared >> shift);
  return m + payload;
}

AttentionInputs SmallInputs(uint64_t seed) {
  return *MakeRandomInputs(DenseAttentionShape(DType::kFP16, 1, 32, 32, 2, 2, 64), seed);
}

class FaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::warn);
    ServerOptions o;
    o.host = "127.0.0.1";
    o.port = 0;
    auto server = AttnServer::Create(o, MakeCpuBackend(2));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
    auto client = AttentionClient::Create(absl::StrCat("127.0.0.1:", server_->port()));
    ASSERT_TRUE(client.ok());
    client_ = *std::move(client);
    ExpectServesCorrectly();  // the client's connection is part of the baseline
    baseline_fds_ = OpenFds();
  }
  void TearDown() override {
    client_.reset();
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(5));
  }

  // A fresh request answers correctly within a second. The executor may
  // still hold cancelled calls it has yet to drop (a storm fills its queue):
  // RESOURCE_EXHAUSTED is retried until the second is up.
  void ExpectServesCorrectly() {
    const AttentionInputs in = SmallInputs(++seed_);
    const absl::Time start = absl::Now();
    absl::StatusOr<ForwardResult> out = client_->Forward(in);
    int refused = 0;
    while (!out.ok() && out.status().code() == absl::StatusCode::kResourceExhausted &&
           absl::Now() - start < absl::Seconds(1)) {
      ++refused;
      out = client_->Forward(in);
    }
    const absl::Duration took = absl::Now() - start;
    ASSERT_TRUE(out.ok()) << out.status() << " after " << refused << " refusals in " << took;
    EXPECT_LT(took, absl::Seconds(1)) << "serving again took " << took;
    if (refused > 0)
      std::printf("serving again after %d queue-full refusals, %s\n", refused,
                  absl::FormatDuration(took).c_str());
    absl::StatusOr<VerifyReport> report = VerifyForward(in, *out);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_TRUE(report->passed) << report->failure;
  }

  // The server let go of every connection the fault opened.
  void ExpectFdsBackToBaseline() {
    EXPECT_TRUE(WaitFor([&] { return OpenFds() <= baseline_fds_; }, absl::Seconds(10)))
        << OpenFds() << " fds open, " << baseline_fds_ << " before the fault";
  }

  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<AttentionClient> client_;
  int baseline_fds_ = 0;
  uint64_t seed_ = 0;
};

TEST_F(FaultTest, ClientsDisconnectingMidUploadLeaveNothingBehind) {
  constexpr int kClients = 40;
  for (int i = 0; i < kClients; ++i) {
    RawHttp2 c(server_->port(), 0);
    ASSERT_TRUE(c.ok()) << "client " << i;
    ASSERT_TRUE(c.SendCallHeaders(1, "/attnserve.v1.Attention/Forward"));
    // A 1 MB message declared, 16 KB of it sent (inside the default 64 KB
    // window), then the connection closes.
    ASSERT_TRUE(c.Send(Frame(kData, 0, 1, GrpcMessage(std::string(16000, 'x'), 1 << 20))));
  }
  ExpectFdsBackToBaseline();
  ExpectServesCorrectly();
}

TEST_F(FaultTest, ClientsDisconnectingMidResponseLeaveNothingBehind) {
  constexpr int kClients = 40;
  // 32 x 8 x 64 FP16 q (k, v with one head): a 32 KB answer, which a 1-byte
  // window stalls.
  const std::string request =
      MakeForwardRequest(
          *MakeRandomInputs(DenseAttentionShape(DType::kFP16, 1, 32, 32, 8, 1, 64), 5))
          .SerializeAsString();
  ASSERT_LT(request.size(), 65535u - 5) << "must fit the server's initial window";
  for (int i = 0; i < kClients; ++i) {
    RawHttp2 c(server_->port(), /*initial_window=*/1);
    ASSERT_TRUE(c.ok()) << "client " << i;
    ASSERT_TRUE(c.SendCallHeaders(1, "/attnserve.v1.Attention/Forward"));
    const std::string message = GrpcMessage(request, static_cast<uint32_t>(request.size()));
    for (size_t at = 0; at < message.size(); at += 16384) {
      const bool last = at + 16384 >= message.size();
      ASSERT_TRUE(c.Send(Frame(kData, last ? kEndStream : 0, 1, message.substr(at, 16384))));
    }
    // The response has begun (its headers came), and cannot finish: close.
    ASSERT_TRUE(c.ReadUntilFrame(kHeaders, 1)) << "client " << i << ": no response headers";
  }
  ExpectFdsBackToBaseline();
  ExpectServesCorrectly();
}

TEST_F(FaultTest, CancellationStormEndsEveryCallAndServingResumes) {
  constexpr int kCalls = 2000;
  const v1::ForwardRequest request = MakeForwardRequest(
      *MakeRandomInputs(DenseAttentionShape(DType::kBF16, 1, 128, 128, 4, 4, 64), 9));
  auto stub = v1::Attention::NewStub(client_->channel(0));
  struct Call {
    grpc::ClientContext context;
    v1::ForwardResponse response;
    grpc::Status status;
  };
  std::vector<std::unique_ptr<Call>> calls;
  std::atomic<int> done{0};
  std::mt19937 rng(3);
  for (int i = 0; i < kCalls; ++i) {
    calls.push_back(std::make_unique<Call>());
    Call* c = calls.back().get();
    stub->async()->Forward(&c->context, &request, &c->response, [c, &done](grpc::Status s) {
      c->status = std::move(s);
      done.fetch_add(1, std::memory_order_release);
    });
    // Cancel earlier calls at random points: some queued, some running, some
    // not yet sent, a few already answered.
    if (i >= 8 && rng() % 4 != 0) calls[size_t(i) - rng() % 8]->context.TryCancel();
  }
  for (auto& c : calls) c->context.TryCancel();
  ASSERT_TRUE(
      WaitFor([&] { return done.load(std::memory_order_acquire) == kCalls; }, absl::Seconds(60)))
      << done.load() << " of " << kCalls << " calls ended";
  int ok = 0, cancelled = 0, exhausted = 0;
  for (auto& c : calls) {
    switch (c->status.error_code()) {
      case grpc::StatusCode::OK: ++ok; break;
      case grpc::StatusCode::CANCELLED: ++cancelled; break;
      case grpc::StatusCode::RESOURCE_EXHAUSTED: ++exhausted; break;  // the queue was full
      default: ADD_FAILURE() << c->status.error_code() << " " << c->status.error_message();
    }
  }
  EXPECT_GT(cancelled, kCalls / 2) << ok << " OK, " << exhausted << " queue full";
  std::printf("cancellation storm: %d OK, %d cancelled, %d queue full\n", ok, cancelled, exhausted);
  calls.clear();
  ExpectFdsBackToBaseline();
  ExpectServesCorrectly();
}

}  // namespace
}  // namespace attnserve
