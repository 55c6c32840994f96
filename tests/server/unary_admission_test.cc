// Why a tenant's unary uploads have no per-tenant cap before they arrive
// (SECURITY.md, "Memory budget"): the cap streams get
// (server/auth/call_admission.h) is decided in a server interceptor when a
// call's metadata has arrived and before any message has. gRPC 1.51 registers
// unary methods to have their first message read by the core before the call
// is handed to C++ (GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER), so the first
// hook an interceptor gets for a unary call already carries the whole message.
// This test pins that on the gRPC the build links: a unary call whose client
// sent its metadata and no message is invisible to interceptors while a
// stream opened after it on the same connection is seen. If a gRPC upgrade
// makes unary calls visible earlier, it fails: the stream cap can then be
// given to unary uploads too.
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "attnserve/v1/attention.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_interceptor.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

constexpr char kEcho[] = "/attnserve.v1.Attention/Echo";
constexpr char kStream[] = "/attnserve.v1.Attention/ForwardStream";

// What interceptors saw: per method, whether its first hook already had a
// received message.
class Seen {
 public:
  void Record(const std::string& method, bool with_message) {
    std::lock_guard<std::mutex> lock(mu_);
    first_hook_had_message_.emplace(method, with_message);
    cv_.notify_all();
  }
  // Waits (up to 30 s) for a call of `method` to reach the interceptors.
  bool WaitFor(const std::string& method) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(30),
                        [&] { return first_hook_had_message_.count(method) > 0; });
  }
  bool Has(const std::string& method) {
    std::lock_guard<std::mutex> lock(mu_);
    return first_hook_had_message_.count(method) > 0;
  }
  bool FirstHookHadMessage(const std::string& method) {
    std::lock_guard<std::mutex> lock(mu_);
    return first_hook_had_message_.at(method);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, bool> first_hook_had_message_;
};

class Recorder final : public grpc::experimental::Interceptor {
 public:
  Recorder(std::string method, Seen* seen) : method_(std::move(method)), seen_(seen) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (!recorded_ &&
        methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      recorded_ = true;
      seen_->Record(method_,
                    methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE));
    }
    methods->Proceed();
  }

 private:
  const std::string method_;
  Seen* const seen_;
  bool recorded_ = false;
};

class RecorderFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RecorderFactory(Seen* seen) : seen_(seen) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new Recorder(info->method(), seen_);
  }

 private:
  Seen* const seen_;
};

// Waits for the completion of `tag` on `cq` (other tags may come first).
bool Await(grpc::CompletionQueue* cq, void* tag) {
  void* got = nullptr;
  bool ok = false;
  while (cq->Next(&got, &ok)) {
    if (got == tag) return ok;
  }
  return false;
}

TEST(UnaryAdmissionTest, UnaryCallsReachInterceptorsOnlyWithTheirMessage) {
  Seen seen;
  // Every method registered as the server registers them (callback API); the
  // handlers answer UNIMPLEMENTED, which does not matter here.
  v1::Attention::CallbackService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(std::make_unique<RecorderFactory>(&seen));
  builder.experimental().SetInterceptorCreators(std::move(creators));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);

  auto channel =
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  // A unary call whose metadata is sent and whose message is not (yet): what
  // a client uploading a large request looks like before its last byte.
  grpc::ClientContext unary_context;
  auto unary = stub.PrepareCall(&unary_context, kEcho, &cq);
  int unary_started = 0;
  unary->StartCall(&unary_started);
  ASSERT_TRUE(Await(&cq, &unary_started));
  // A stream opened after it on the same connection (HTTP/2 delivers the
  // two calls' headers in that order).
  grpc::ClientContext stream_context;
  auto stream = stub.PrepareCall(&stream_context, kStream, &cq);
  int stream_started = 0;
  stream->StartCall(&stream_started);
  ASSERT_TRUE(Await(&cq, &stream_started));

  // The stream reaches the interceptors on its metadata alone...
  ASSERT_TRUE(seen.WaitFor(kStream));
  EXPECT_FALSE(seen.FirstHookHadMessage(kStream));
  // ...the unary call, opened first, does not: nothing could count it yet.
  EXPECT_FALSE(seen.Has(kEcho)) << "gRPC now shows unary calls to interceptors before their "
                                   "message: a per-tenant cap on receiving unary calls is "
                                   "possible (SECURITY.md, \"Memory budget\")";

  // Once its message is complete it does, and its first hook carries it.
  v1::ForwardRequest request;
  request.set_request_id("x");
  std::string bytes = request.SerializeAsString();
  grpc::Slice slice(bytes);
  grpc::ByteBuffer buffer(&slice, 1);
  int written = 0;
  unary->WriteLast(buffer, grpc::WriteOptions(), &written);
  ASSERT_TRUE(Await(&cq, &written));
  ASSERT_TRUE(seen.WaitFor(kEcho));
  EXPECT_TRUE(seen.FirstHookHadMessage(kEcho));

  grpc::Status unary_status, stream_status;
  int unary_done = 0, stream_done = 0;
  unary->Finish(&unary_status, &unary_done);
  EXPECT_TRUE(Await(&cq, &unary_done));
  stream_context.TryCancel();
  stream->Finish(&stream_status, &stream_done);
  EXPECT_TRUE(Await(&cq, &stream_done));
  server->Shutdown();
  cq.Shutdown();
  void* tag;
  bool ok;
  while (cq.Next(&tag, &ok)) {
  }
}

}  // namespace
}  // namespace attnserve
