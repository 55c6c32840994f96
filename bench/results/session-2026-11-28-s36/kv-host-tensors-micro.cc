// The host copies a unary K/V step's tensors take on a CUDA server, old path
// against the new one, at the GPU decode loop's bytes (q 512 KiB, k/v 128 KiB
// each, o 512 KiB), alternated in one process with the server's malloc
// settings. Old: protobuf parses the raw request (q/k/v copied into the
// message's strings), the staged launch gathers them into pinned staging
// (a second copy; here a reused buffer standing in for it), o is scattered
// from staging into the answer's buffer (a third). New: the slices are
// copied once into the backend's pooled blocks (here a reused-block pool as
// the CUDA backend's, heap instead of page-locked), nothing gathered or
// scattered (the DMA reads and writes the blocks). The request arrives as
// the new client sends it (message, then q/k/v as slices of their own).
// Build: g++ -O3 -std=c++17 with the server's include and link line (see
// the NOTES section); run: ./micro [STEPS].
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <vector>

#include "attnserve/v1/kv.pb.h"
#include "common/malloc_tuning.h"
#include "common/tensor_wire_slices.h"
#include "server/native/kv_messages.h"
#include "server/native/kv_service.h"

using namespace attnserve;
using Clock = std::chrono::steady_clock;

namespace {

// Reused blocks by size, as the CUDA backend's pinned pool.
struct BlockPool : std::enable_shared_from_this<BlockPool> {
  std::mutex mu;
  std::map<int64_t, std::vector<char*>> free;
  std::shared_ptr<char> Get(int64_t n) {
    char* p = nullptr;
    {
      std::lock_guard<std::mutex> l(mu);
      auto& v = free[n];
      if (!v.empty()) {
        p = v.back();
        v.pop_back();
      }
    }
    if (p == nullptr) p = new char[size_t(n)];
    auto self = shared_from_this();
    return std::shared_ptr<char>(p, [self, n](char* b) {
      std::lock_guard<std::mutex> l(self->mu);
      self->free[n].push_back(b);
    });
  }
};

std::string Bytes(std::mt19937* rng, size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; i += 4) {
    uint32_t r = (*rng)();
    std::memcpy(&s[i], &r, std::min<size_t>(4, n - i));
  }
  return s;
}

grpc::ByteBuffer Wire(const v1::AppendAttendRequest& r) {
  v1::AppendAttendRequest m = r;
  TensorWireSlices t;
  using R = v1::AppendAttendRequest;
  t.TakeData(R::kQFieldNumber, m.mutable_q()->mutable_data());
  t.TakeData(R::kKFieldNumber, m.mutable_k()->mutable_data());
  t.TakeData(R::kVFieldNumber, m.mutable_v()->mutable_data());
  return t.Encode(m);
}

double Us(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

}  // namespace

int main(int argc, char** argv) {
  TuneMallocForTensors();
  const int steps = argc > 1 ? std::atoi(argv[1]) : 1000;
  std::mt19937 rng(1);
  v1::AppendAttendRequest r;
  r.set_cache_id("c-0123456789abcdef");
  for (int s = 0; s < 64; ++s) {
    v1::SequenceStep* st = r.add_sequences();
    st->set_sequence_id(s);
    st->set_expected_length(8192);
    st->set_num_new_tokens(1);
    st->set_num_queries(1);
  }
  auto set = [&](v1::Tensor* t, int heads, size_t bytes) {
    t->set_dtype(v1::BF16);
    t->add_shape(64);
    t->add_shape(heads);
    t->add_shape(128);
    t->set_data(Bytes(&rng, bytes));
  };
  set(r.mutable_q(), 32, 512 << 10);
  set(r.mutable_k(), 8, 128 << 10);
  set(r.mutable_v(), 8, 128 << 10);
  const std::string o_src = Bytes(&rng, 512 << 10);
  auto pool = std::make_shared<BlockPool>();
  std::vector<char> staging(2 << 20);  // the slot's pinned buffer, reused
  std::vector<double> old_us, new_us;
  for (int i = 0; i < steps; ++i) {
    for (int which = 0; which < 2; ++which) {
      grpc::ByteBuffer buf = Wire(r);  // outside the timed part
      const bool old = (i + which) % 2 == 0;
      const auto t0 = Clock::now();
      if (old) {
        v1::AppendAttendRequest req;
        ParseAppendAttend(&buf, &req);
        // Gather into staging, then o: staging -> the answer's buffer.
        size_t at = 0;
        for (const std::string* d : {&req.q().data(), &req.k().data(), &req.v().data()}) {
          std::memcpy(staging.data() + at, d->data(), d->size());
          at += (d->size() + 255) / 256 * 256;
        }
        std::memcpy(staging.data() + at, o_src.data(), o_src.size());  // the D2H's write
        std::unique_ptr<char[]> o(new char[o_src.size()]);
        std::memcpy(o.get(), staging.data() + at, o_src.size());
        asm volatile("" : : "r"(o.get()) : "memory");
      } else {
        v1::AppendAttendRequest req;
        KvStagedInputs staged;
        ParseAppendAttendStaged(
            &buf, [&](int64_t n) { return pool->Get(n); }, &req, &staged);
        std::shared_ptr<char> o = pool->Get(int64_t(o_src.size()));
        std::memcpy(o.get(), o_src.data(), o_src.size());  // the D2H's write
        asm volatile("" : : "r"(o.get()) : "memory");
      }
      (old ? old_us : new_us).push_back(Us(t0, Clock::now()));
    }
  }
  for (auto* v : {&old_us, &new_us}) std::sort(v->begin(), v->end());
  auto q = [](const std::vector<double>& v, double f) { return v[size_t(f * (v.size() - 1))]; };
  std::printf(
      "steps %d each, us: old p10 %.1f p50 %.1f p90 %.1f | new p10 %.1f p50 %.1f p90 %.1f\n", steps,
      q(old_us, .1), q(old_us, .5), q(old_us, .9), q(new_us, .1), q(new_us, .5), q(new_us, .9));
}
