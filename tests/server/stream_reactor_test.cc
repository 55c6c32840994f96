// PipelinedStreamReactor (server/stream_reactor.h) over the wire: a request
// whose start throws is answered in-band with the exception's status (bad_alloc
// as RESOURCE_EXHAUSTED, anything else INTERNAL with its message), the stream
// goes on, every request's in-flight count is given back and the server shuts
// down at once. Before the boundary existed, the throw escaped the reactor,
// the stream never answered again and shutdown waited for ever.
#include "server/stream_reactor.h"

#include <memory>
#include <new>
#include <stdexcept>
#include <string>

#include "attnserve/v1/attention.grpc.pb.h"
#include "common/grpc_status.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "server/in_flight.h"
#include "server/stream_flow_control.h"

namespace attnserve {
namespace {

using Reactor = PipelinedStreamReactor<v1::ForwardRequest, v1::ForwardResponse>;

// ForwardStream whose start throws for request ids "throw" and "oom" and
// answers every other request at once.
class ThrowingService final : public v1::Attention::CallbackService {
 public:
  grpc::ServerBidiReactor<v1::ForwardRequest, v1::ForwardResponse>* ForwardStream(
      grpc::CallbackServerContext*) override {
    auto start = [](Reactor::Call* call, Reactor::Done done) {
      if (call->request.request_id() == "throw") throw std::runtime_error("injected failure");
      if (call->request.request_id() == "oom") throw std::bad_alloc();
      call->response.set_request_id(call->request.request_id());
      done(absl::OkStatus());
    };
    auto fail = [](Reactor::Call* call, const absl::Status& status) {
      call->response.set_request_id(call->request.request_id());
      call->response.set_error_code(ToRpcCode(status));
      call->response.set_error_message(std::string(status.message()));
    };
    return new Reactor(&in_flight, std::make_shared<std::atomic<bool>>(false), std::move(start),
                       std::move(fail), StreamLimits{}, nullptr);
  }
  InFlightCounter in_flight;
};

TEST(StreamReactorTest, AThrowingStartIsAnsweredInBandAndReleasesItsCount) {
  ThrowingService service;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto stub = v1::Attention::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto stream = stub->ForwardStream(&context);
  for (const char* id : {"throw", "oom", "fine"}) {
    v1::ForwardRequest request;
    request.set_request_id(id);
    ASSERT_TRUE(stream->Write(request));
  }
  ASSERT_TRUE(stream->WritesDone());
  std::map<std::string, v1::ForwardResponse> answers;
  v1::ForwardResponse response;
  while (stream->Read(&response)) answers[response.request_id()] = response;
  EXPECT_TRUE(stream->Finish().ok());
  ASSERT_EQ(answers.size(), 3u);
  EXPECT_EQ(answers["throw"].error_code(), ToRpcCode(absl::InternalError("")));
  EXPECT_NE(answers["throw"].error_message().find("injected failure"), std::string::npos)
      << answers["throw"].error_message();
  EXPECT_EQ(answers["oom"].error_code(), ToRpcCode(absl::ResourceExhaustedError("")));
  EXPECT_FALSE(answers["oom"].error_message().empty());
  EXPECT_EQ(answers["fine"].error_code(), 0);
  // Every request's count came back: a drain has nothing to wait for.
  EXPECT_TRUE(service.in_flight.WaitForZero(absl::Seconds(10)));
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

}  // namespace
}  // namespace attnserve
