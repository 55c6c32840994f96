// The closed and open loops of `attnctl load`, unary or streaming.
#include "client/cli/load_loops.h"

#include <grpcpp/client_context.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace attnserve {
namespace cli {
namespace {

// Deadline of a stream that must outlive the step by one call's timeout.
void SetStreamDeadline(grpc::ClientContext* ctx, const LoadConfig& config, absl::Time stop) {
  if (config.timeout != absl::InfiniteDuration()) {
    ctx->set_deadline(absl::ToChronoTime(stop + config.timeout));
  }
  if (config.wait_for_ready) ctx->set_wait_for_ready(true);
}

void RecordCall(Recorder& rec, const Workload& w, int input, absl::Time sent, absl::Status status,
                v1::ForwardResponse* response) {
  rec.Record(ForwardCompletion(w, input, sent, std::move(status), response));
}

// One ForwardStream of the open loop: a writer side shared by the dispatcher
// (under mu) and a reader thread that matches responses by request_id.
struct OpenStream {
  grpc::ClientContext ctx;
  std::unique_ptr<v1::Attention::Stub> stub;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ForwardRequest, v1::ForwardResponse>> rw;
  // This stream's own copies, because request_id is set before each write.
  std::vector<v1::ForwardRequest> requests;
  absl::Mutex mu;
  std::map<std::string, std::pair<int, absl::Time>> pending ABSL_GUARDED_BY(mu);
  std::thread reader;
};

}  // namespace

void RunClosedLoop(AttentionClient& client, V2Client* v2, const Workload& w,
                   const LoadConfig& config, int callers, absl::Time stop, Recorder& rec) {
  const int n = static_cast<int>(w.requests.size());
  std::vector<std::thread> threads;
  for (int c = 0; c < callers; ++c) {
    threads.emplace_back([&, c] {
      int input = c % n;
      // With shared memory a caller sends one input, written into its region
      // once (as perf_analyzer does): the bytes are already where the server
      // reads them, which is what shared memory is for. The outputs are read
      // back only to be checked.
      const bool staged = v2 != nullptr && v2->shm() != V2Shm::kNone;
      auto call = [&]() -> absl::StatusOr<v1::ForwardResponse> {
        if (staged) {
          return v2->ForwardStaged(w.requests[input], input, c, !w.verifiers.empty());
        }
        if (v2 != nullptr) return v2->Infer(w.v2_requests[input]);
        return w.echo ? client.Echo(w.requests[input]) : client.Forward(w.requests[input]);
      };
      if (!config.stream) {
        while (absl::Now() < stop) {
          const absl::Time sent = absl::Now();
          absl::StatusOr<v1::ForwardResponse> r = call();
          RecordCall(rec, w, input, sent, r.status(), r.ok() ? &*r : nullptr);
          if (!staged) input = (input + 1) % n;
        }
        return;
      }
      auto stub = v1::Attention::NewStub(client.channel(c % client.num_channels()));
      grpc::ClientContext ctx;
      SetStreamDeadline(&ctx, config, stop);
      auto rw = stub->ForwardStream(&ctx);
      v1::ForwardResponse response;
      while (absl::Now() < stop) {
        const absl::Time sent = absl::Now();
        if (!rw->Write(w.requests[input]) || !rw->Read(&response)) break;
        RecordCall(rec, w, input, sent, absl::OkStatus(), &response);
        input = (input + 1) % n;
      }
      rw->WritesDone();
      while (rw->Read(&response)) {
      }
      const grpc::Status st = rw->Finish();
      // A stream that broke takes the request in flight with it.
      if (!st.ok()) RecordCall(rec, w, input, absl::Now(), ToAbslStatus(st), nullptr);
    });
  }
  for (std::thread& t : threads) t.join();
}

void RunOpenLoop(AttentionClient& client, V2Client* v2, const Workload& w, const LoadConfig& config,
                 double rate, absl::Time stop, Recorder& rec) {
  const int n = static_cast<int>(w.requests.size());
  std::atomic<int> outstanding{0};
  std::vector<std::unique_ptr<OpenStream>> streams;
  if (config.stream) {
    for (int i = 0; i < client.num_channels(); ++i) {
      auto s = std::make_unique<OpenStream>();
      s->stub = v1::Attention::NewStub(client.channel(i));
      SetStreamDeadline(&s->ctx, config, stop);
      s->rw = s->stub->ForwardStream(&s->ctx);
      s->requests = w.requests;
      s->reader = std::thread([&rec, &w, &outstanding, s = s.get()] {
        v1::ForwardResponse response;
        while (s->rw->Read(&response)) {
          std::pair<int, absl::Time> sent;
          {
            absl::MutexLock lock(&s->mu);
            auto it = s->pending.find(response.request_id());
            if (it == s->pending.end()) continue;
            sent = it->second;
            s->pending.erase(it);
          }
          RecordCall(rec, w, sent.first, sent.second, absl::OkStatus(), &response);
          outstanding.fetch_sub(1);
        }
      });
      streams.push_back(std::move(s));
    }
  }
  std::mt19937_64 rng(std::random_device{}());
  std::exponential_distribution<double> gap(rate);
  absl::Time next = absl::Now();
  for (int64_t i = 0;; ++i) {
    next += absl::Seconds(gap(rng));
    if (next >= stop) break;
    absl::SleepFor(next - absl::Now());
    if (outstanding.load() >= config.max_outstanding) {
      rec.RecordDropped();
      continue;
    }
    const int input = static_cast<int>(i % n);
    outstanding.fetch_add(1);
    if (!config.stream) {
      auto done = [&rec, &w, &outstanding, input,
                   sent = next](absl::StatusOr<v1::ForwardResponse> r) {
        RecordCall(rec, w, input, sent, r.status(), r.ok() ? &*r : nullptr);
        outstanding.fetch_sub(1);
      };
      if (v2 != nullptr) {
        v2->InferAsync(w.v2_requests[input], std::move(done));
      } else if (w.echo) {
        client.EchoAsync(w.requests[input], CallOptions(), std::move(done));
      } else {
        client.ForwardAsync(w.requests[input], CallOptions(), std::move(done));
      }
      continue;
    }
    OpenStream& s = *streams[i % streams.size()];
    const std::string id = absl::StrCat(i);
    absl::MutexLock lock(&s.mu);
    s.pending[id] = {input, next};
    s.requests[input].set_request_id(id);
    s.rw->Write(s.requests[input]);
  }
  // Requests in flight get one call timeout to finish.
  const absl::Time give_up = absl::Now() + std::min(config.timeout, absl::Hours(1));
  while (outstanding.load() > 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
  for (auto& s : streams) {
    s->rw->WritesDone();
    s->reader.join();
    const grpc::Status st = s->rw->Finish();
    absl::MutexLock lock(&s->mu);
    for (const auto& [id, sent] : s->pending) {
      RecordCall(
          rec, w, sent.first, sent.second,
          st.ok() ? absl::DeadlineExceededError("no response on the stream") : ToAbslStatus(st),
          nullptr);
      outstanding.fetch_sub(1);
    }
  }
  // Unary calls still in flight hold references to `rec` and `outstanding`.
  while (outstanding.load() > 0) absl::SleepFor(absl::Milliseconds(5));
}

}  // namespace cli
}  // namespace attnserve
