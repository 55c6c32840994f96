// The attnserve binary as a user runs it: --help lists the flags, a bad
// --log_level is refused, and SIGTERM/SIGINT after startup drain and exit 0
// while the health service answered SERVING in between.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

// The binary under test: $ATTNSERVE_BINARY (e.g. the static build) or the one
// built beside this test.
std::string BinaryPath() {
  const char* env = std::getenv("ATTNSERVE_BINARY");
  return env != nullptr && env[0] != '\0' ? env : ATTNSERVE_BINARY;
}

// A child attnserve whose stdout and stderr come back through one pipe.
class Child {
 public:
  explicit Child(const std::vector<std::string>& flags) {
    int fds[2];
    if (pipe(fds) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], STDOUT_FILENO);
      dup2(fds[1], STDERR_FILENO);
      close(fds[0]);
      close(fds[1]);
      std::vector<std::string> args = {BinaryPath()};
      args.insert(args.end(), flags.begin(), flags.end());
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(fds[1]);
    out_ = fdopen(fds[0], "r");
  }

  ~Child() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_ != nullptr) fclose(out_);
  }

  // Reads output lines until one contains `needle` (returned) or EOF ("").
  std::string ReadUntil(const std::string& needle) {
    char line[4096];
    while (out_ != nullptr && fgets(line, sizeof(line), out_) != nullptr) {
      output_ += line;
      if (std::string(line).find(needle) != std::string::npos) return line;
    }
    return "";
  }

  // Reads the rest of the output and the exit status (-1 unless exited normally).
  int Wait() {
    ReadUntil("\x01never\x01");
    int status = 0;
    waitpid(pid_, &status, 0);
    reaped_ = true;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  pid_t pid() const { return pid_; }
  const std::string& output() const { return output_; }

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  FILE* out_ = nullptr;
  std::string output_;
};

TEST(AttnserveBinaryTest, HelpListsFlags) {
  Child child({"--help"});
  const int code = child.Wait();
  EXPECT_EQ(code, 1) << "absl's --help exits 1";
  for (const char* flag :
       {"--host", "--port", "--backend", "--threads", "--devices", "--max_request_bytes",
        "--max_tokens", "--max_queue_size", "--log_level", "--shutdown_grace", "--http_port",
        "--allow_client_shm"}) {
    EXPECT_NE(child.output().find(flag), std::string::npos) << flag << "\n" << child.output();
  }
}

TEST(AttnserveBinaryTest, BadLogLevelIsRefused) {
  Child child({"--log_level=loud", "--port=0"});
  EXPECT_EQ(child.Wait(), 2);
  EXPECT_NE(child.output().find("--log_level"), std::string::npos) << child.output();
}

void ServeThenSignal(int signal_number) {
  Child child({"--host=127.0.0.1", "--port=0", "--backend=cpu", "--threads=1", "--metrics_port=0"});
  const std::string line = child.ReadUntil("listening on");
  ASSERT_FALSE(line.empty()) << child.output();
  // "... listening on 127.0.0.1:PORT backend=cpu ..."
  const size_t colon = line.find("127.0.0.1:");
  ASSERT_NE(colon, std::string::npos) << line;
  const size_t start = colon + std::string("127.0.0.1:").size();
  int port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(line.substr(start, line.find(' ', start) - start), &port)) << line;
  EXPECT_NE(line.find("backend=cpu"), std::string::npos) << line;

  auto health = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::health::v1::HealthCheckResponse response;
  ASSERT_TRUE(health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &response).ok());
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);

  ASSERT_EQ(kill(child.pid(), signal_number), 0);
  EXPECT_EQ(child.Wait(), 0) << child.output();
  EXPECT_NE(child.output().find("shutting down"), std::string::npos) << child.output();
}

TEST(AttnserveBinaryTest, SigtermDrainsAndExitsZero) { ServeThenSignal(SIGTERM); }
TEST(AttnserveBinaryTest, SigintDrainsAndExitsZero) { ServeThenSignal(SIGINT); }

}  // namespace
}  // namespace attnserve
