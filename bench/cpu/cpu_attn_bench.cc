// cpu_attn_bench: the fused CPU backend ("ours") side by side with a naive
// materialised attention ("naive": S = QKᵀ for every head written to memory,
// softmax over it, then P·V; the "standard attention" of the FlashAttention
// papers), on the grid: B = 1, H = 8, D = 64, N in {512..4096}, FP32,
// causal and not. Both are validated against the float64 reference before
// they are timed. Prints CSV (bench/README.md describes the columns).
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/cpu_attention_kernel.h"
#include "backend/cpu/cpu_backend.h"
#include "common/dtype.h"
#include "common/thread_pool.h"
#include "tests/common/attn_test_util.h"

// ---------------------------------------------------------------------------
// Counting allocator: every operator new/delete of this process goes through
// malloc and is counted by malloc_usable_size, so "peak extra memory" is what
// an implementation really allocated during a call (an upper bound by the
// allocator's rounding), not a formula. Thread stacks and memory from aligned
// new are not counted (neither implementation uses aligned new).
namespace {
std::atomic<int64_t> g_live_bytes{0};
std::atomic<int64_t> g_peak_bytes{0};

void* CountedAlloc(std::size_t n) {
  void* ptr = std::malloc(n == 0 ? 1 : n);
  if (ptr == nullptr) return nullptr;
  const int64_t live = g_live_bytes.fetch_add(malloc_usable_size(ptr), std::memory_order_relaxed) +
                       static_cast<int64_t>(malloc_usable_size(ptr));
  int64_t peak = g_peak_bytes.load(std::memory_order_relaxed);
  while (live > peak && !g_peak_bytes.compare_exchange_weak(peak, live)) {
  }
  return ptr;
}

void CountedFree(void* ptr) {
  if (ptr == nullptr) return;
  g_live_bytes.fetch_sub(malloc_usable_size(ptr), std::memory_order_relaxed);
  std::free(ptr);
}
}  // namespace

void* operator new(std::size_t n) {
  void* p = CountedAlloc(n);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
void* operator new[](std::size_t n) { return operator new(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return CountedAlloc(n); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return CountedAlloc(n); }
void operator delete(void* p) noexcept { CountedFree(p); }
void operator delete[](void* p) noexcept { CountedFree(p); }
void operator delete(void* p, std::size_t) noexcept { CountedFree(p); }
void operator delete[](void* p, std::size_t) noexcept { CountedFree(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { CountedFree(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { CountedFree(p); }

namespace attnserve {
namespace {

using testing_util::HostBuffers;
using testing_util::TestCase;

// ---------------------------------------------------------------------------
// Naive materialised attention, dense FP32 only. Three passes, each
// multi-threaded over (b, h, block of 64 query rows) on the same kind of pool
// as the backend: (1) S = scale·log2(e)·QKᵀ for all rows and keys into one
// [B, Hq, Sq, Sk] buffer, then the mask; (2) softmax of each row in place
// (the same vectorised exp2 as ours); (3) O = P·V. Inner loops are contiguous and
// vectorised like ours (K transposed once so the score loop runs along keys);
// what differs is the algorithm: the N×N matrix in memory, full rows computed
// even where causal masks them, three trips through it.
class NaiveAttention {
 public:
  explicit NaiveAttention(int threads) : pool_(threads) {}

  void Run(const AttnParams& p) {
    const int d = p.head_dim, hq = p.num_heads_q, hkv = p.num_heads_kv;
    const int sq = p.seqlen_q, sk = p.seqlen_k;
    const float* q = static_cast<const float*>(p.q);
    const float* k = static_cast<const float*>(p.k);
    const float* v = static_cast<const float*>(p.v);
    float* o = static_cast<float*>(p.o);
    std::vector<float> kt(static_cast<size_t>(p.batch) * hkv * d * sk);  // [B, Hkv, D, Sk]
    std::vector<float> s(static_cast<size_t>(p.batch) * hq * sq * sk);   // [B, Hq, Sq, Sk]
    for (int b = 0; b < p.batch; ++b) {
      for (int h = 0; h < hkv; ++h) {
        float* dst = &kt[(static_cast<size_t>(b) * hkv + h) * d * sk];
        for (int j = 0; j < sk; ++j) {
          const float* src = k + KVOffset(p, SeqStartK(p, b) + j, h);
          for (int c = 0; c < d; ++c) dst[static_cast<size_t>(c) * sk + j] = src[c];
        }
      }
    }
    const int m_blocks = (sq + 63) / 64;
    const int64_t tasks = int64_t{p.batch} * hq * m_blocks;
    auto rows_of = [&](int64_t task, int* b, int* h, int* r0, int* r1) {
      *b = static_cast<int>(task / (int64_t{hq} * m_blocks));
      *h = static_cast<int>(task / m_blocks % hq);
      *r0 = static_cast<int>(task % m_blocks) * 64;
      *r1 = std::min(sq, *r0 + 64);
    };
    auto s_row = [&](int b, int h, int i) {
      return &s[((static_cast<size_t>(b) * hq + h) * sq + i) * sk];
    };
    pool_.Run(tasks, [&](int, int64_t task) {  // pass 1: scores and mask
      int b, h, r0, r1;
      rows_of(task, &b, &h, &r0, &r1);
      const float* kth = &kt[(static_cast<size_t>(b) * hkv + KVHead(p, h)) * d * sk];
      for (int i = r0; i < r1; ++i) {
        float* row = s_row(b, h, i);
        std::fill(row, row + sk, 0.0f);
        const float* qi = q + QOffset(p, SeqStartQ(p, b) + i, h);
        for (int c = 0; c < d; ++c) {
          const float qc = qi[c] * p.softmax_scale_log2;
          const float* kc = kth + static_cast<size_t>(c) * sk;
          for (int j = 0; j < sk; ++j) row[j] += qc * kc[j];
        }
        int lo, hi;
        VisibleKeys(p, i, sq, sk, &lo, &hi);
        for (int j = 0; j < sk; ++j) {
          if (j < lo || j > hi) row[j] = -INFINITY;
        }
      }
    });
    pool_.Run(tasks, [&](int, int64_t task) {  // pass 2: softmax in place
      int b, h, r0, r1;
      rows_of(task, &b, &h, &r0, &r1);
      for (int i = r0; i < r1; ++i) {
        float* row = s_row(b, h, i);
        cpu::Vec8 m8 = cpu::Splat8(-INFINITY);
        int t = 0;
        for (; t + cpu::kLanes <= sk; t += cpu::kLanes) {
          const cpu::Vec8 x = cpu::Load8(row + t);
          m8 = x > m8 ? x : m8;
        }
        float m = -INFINITY;
        for (int l = 0; l < cpu::kLanes; ++l) m = std::max(m, m8[l]);
        for (; t < sk; ++t) m = std::max(m, row[t]);
        if (m == -INFINITY) {
          std::fill(row, row + sk, 0.0f);
          continue;
        }
        cpu::Vec8 sum8 = {};
        int j = 0;
        for (; j + cpu::kLanes <= sk; j += cpu::kLanes) {
          const cpu::Vec8 e = cpu::Exp2NonPositive8(cpu::Load8(row + j) - m);
          cpu::Store8(row + j, e);
          sum8 += e;
        }
        float sum = 0.0f;
        for (int l = 0; l < cpu::kLanes; ++l) sum += sum8[l];
        for (; j < sk; ++j) {
          row[j] = cpu::Exp2NonPositive(row[j] - m);
          sum += row[j];
        }
        const float inv = 1.0f / sum;
        for (int j = 0; j < sk; ++j) row[j] *= inv;
      }
    });
    pool_.Run(tasks, [&](int, int64_t task) {  // pass 3: O = P·V
      int b, h, r0, r1;
      rows_of(task, &b, &h, &r0, &r1);
      const int hk = KVHead(p, h);
      for (int i = r0; i < r1; ++i) {
        const float* row = s_row(b, h, i);
        float* oi = o + QOffset(p, SeqStartQ(p, b) + i, h);
        std::fill(oi, oi + d, 0.0f);
        for (int j = 0; j < sk; ++j) {
          const float pj = row[j];
          const float* vj = v + KVOffset(p, SeqStartK(p, b) + j, hk);
          for (int c = 0; c < d; ++c) oi[c] += pj * vj[c];
        }
      }
    });
  }

 private:
  ThreadPool pool_;
};

// ---------------------------------------------------------------------------

struct Options {
  std::vector<int> ns = {512, 1024, 2048, 4096};
  int heads = 8;
  int head_dim = 64;
  int runs = 7;
  int warmup = 1;
  int threads = 0;
  std::string machine;
  std::string out;
  bool validate = true;
};

void PrintHelp() {
  std::printf(
      "cpu_attn_bench: fused CPU attention (ours) vs naive materialised attention.\n"
      "Grid: B=1, H=--heads, D=--head_dim, N in --n, FP32, causal and not.\n"
      "Each implementation is validated against the float64 reference (at the\n"
      "same N with one head) and against the other (all heads) before timing.\n\n"
      "Flags:\n"
      "  --n=512,1024,2048,4096  sequence lengths (Sq = Sk = N)\n"
      "  --heads=8               query = KV heads\n"
      "  --head_dim=64           D\n"
      "  --runs=7                timed runs per row (median reported; at least 5)\n"
      "  --warmup=1              untimed runs first\n"
      "  --threads=0             threads of both implementations (0 = hardware)\n"
      "  --machine=NAME          machine name for the CSV header (default: hostname)\n"
      "  --out=PATH              write the CSV here (default: stdout)\n"
      "  --novalidate            skip validation (not for committed results)\n"
      "  --help                  this text\n");
}

bool ParseFlags(int argc, char** argv, Options* opt) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&a](const char* name) -> const char* {
      const size_t len = std::strlen(name);
      return a.compare(0, len, name) == 0 ? a.c_str() + len : nullptr;
    };
    if (a == "--help" || a == "-h") {
      PrintHelp();
      std::exit(0);
    } else if (const char* v = value("--n=")) {
      opt->ns.clear();
      for (const char* s = v; *s;) {
        char* end;
        opt->ns.push_back(static_cast<int>(std::strtol(s, &end, 10)));
        s = *end == ',' ? end + 1 : end;
        if (end == s && *s) return false;
      }
    } else if (const char* v = value("--heads=")) {
      opt->heads = std::atoi(v);
    } else if (const char* v = value("--head_dim=")) {
      opt->head_dim = std::atoi(v);
    } else if (const char* v = value("--runs=")) {
      opt->runs = std::max(5, std::atoi(v));
    } else if (const char* v = value("--warmup=")) {
      opt->warmup = std::max(0, std::atoi(v));
    } else if (const char* v = value("--threads=")) {
      opt->threads = std::atoi(v);
    } else if (const char* v = value("--machine=")) {
      opt->machine = v;
    } else if (const char* v = value("--out=")) {
      opt->out = v;
    } else if (a == "--novalidate") {
      opt->validate = false;
    } else {
      std::fprintf(stderr, "unknown flag %s (see --help)\n", a.c_str());
      return false;
    }
  }
  return true;
}

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

// One call of an implementation, with its extra memory measured: the peak of
// live allocated bytes during the call minus the live bytes before it.
struct Measured {
  double ms;
  int64_t extra_bytes;
};

template <typename Fn>
Measured TimeOnce(Fn&& fn) {
  const int64_t before = g_live_bytes.load();
  g_peak_bytes.store(before);
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  const auto t1 = std::chrono::steady_clock::now();
  return {std::chrono::duration<double, std::milli>(t1 - t0).count(), g_peak_bytes.load() - before};
}

TestCase BenchCase(int n, int heads, int d, bool causal) {
  TestCase tc;
  tc.dtype = DType::kFP32;
  tc.seqlen_q = tc.seqlen_k = n;
  tc.num_heads_q = tc.num_heads_kv = heads;
  tc.head_dim = d;
  tc.causal = causal;
  tc.return_lse = false;
  return tc;
}

// Both implementations against the float64 reference at this N with one
// head (the reference is O(N²·D) in double, so all heads at N = 4096 would
// take minutes); the timed all-head outputs are cross-checked afterwards.
bool Validate(CpuBackend* ours, NaiveAttention* naive, int n, int d, bool causal) {
  HostBuffers buf(BenchCase(n, 1, d, causal));
  if (!PlanAndForward(*ours, buf.params(), nullptr).ok()) return false;
  std::string err = testing_util::CheckOutputError(buf, buf.o(), buf.lse());
  if (!err.empty()) {
    std::fprintf(stderr, "ours failed validation: %s\n", err.c_str());
    return false;
  }
  buf.Poison();
  naive->Run(buf.params());
  err = testing_util::CheckOutputError(buf, buf.o(), buf.lse());
  if (!err.empty()) {
    std::fprintf(stderr, "naive failed validation: %s\n", err.c_str());
    return false;
  }
  return true;
}

int Main(int argc, char** argv) {
  Options opt;
  if (!ParseFlags(argc, argv, &opt)) return 2;
  if (opt.threads <= 0)
    opt.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (opt.machine.empty()) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    opt.machine = host;
  }
  std::FILE* out = stdout;
  if (!opt.out.empty()) {
    out = std::fopen(opt.out.c_str(), "w");
    if (out == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", opt.out.c_str());
      return 1;
    }
  }
  char date[64];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  std::fprintf(out,
               "# cpu_attn_bench: fused CPU attention (ours) vs naive materialised attention\n");
  std::fprintf(out, "# machine: %s\n# cpu: %s\n# threads: %d (hardware threads: %u)\n",
               opt.machine.c_str(), CpuModel().c_str(), opt.threads,
               std::thread::hardware_concurrency());
  std::fprintf(out, "# compiler: g++ %s, flags: -O3 -march=x86-64-v3 -ffp-contract=fast\n",
               __VERSION__);
  std::fprintf(out, "# date: %s\n", date);
  {
    // Other work on the machine skews the numbers: say how busy it was.
    std::ifstream load("/proc/loadavg");
    std::string avg;
    std::getline(load, avg);
    std::fprintf(out, "# loadavg at start: %s\n", avg.c_str());
  }
  std::fprintf(out,
               "# ms: median of %d runs after %d warm-up; gflops = 4*B*H*Sq*Sk*D (halved if "
               "causal) / time\n",
               opt.runs, opt.warmup);
  std::fprintf(out,
               "# peak_mem_bytes: peak extra heap bytes live during one call beyond inputs and "
               "outputs, measured by a counting operator new (malloc_usable_size)\n");
  std::fprintf(out,
               "# validated: each impl vs the float64 reference at the same N (1 head), and ours "
               "vs naive on every timed output (max |diff| < 1e-4)\n");
  std::fprintf(out,
               "kind,dtype,d,b,hq,hkv,sq,sk,causal,impl,ms,gflops,tflops,tbps,peak_mem_bytes,"
               "threads,runs\n");
  std::fflush(out);

  CpuBackend ours(opt.threads);
  NaiveAttention naive(opt.threads);
  for (int n : opt.ns) {
    for (bool causal : {false, true}) {
      if (opt.validate && !Validate(&ours, &naive, n, opt.head_dim, causal)) return 1;
      HostBuffers buf(BenchCase(n, opt.heads, opt.head_dim, causal));
      const AttnParams& p = buf.params();
      const absl::StatusOr<Plan> plan = ours.CanImplement(p);
      if (!plan.ok()) {
        std::fprintf(stderr, "ours: %s\n", std::string(plan.status().message()).c_str());
        return 1;
      }
      std::vector<float> ours_out;
      double flops =
          4.0 * p.batch * p.num_heads_q * static_cast<double>(p.seqlen_q) * p.seqlen_k * p.head_dim;
      if (causal) flops /= 2;
      for (const char* impl : {"ours", "naive"}) {
        const bool is_ours = std::strcmp(impl, "ours") == 0;
        auto call = [&] {
          if (is_ours) {
            absl::Status s = ours.Forward(*plan, p, nullptr);
            if (!s.ok()) std::fprintf(stderr, "ours: %s\n", std::string(s.message()).c_str());
          } else {
            naive.Run(p);
          }
        };
        for (int w = 0; w < opt.warmup; ++w) call();
        std::vector<double> ms;
        int64_t peak = 0;
        for (int r = 0; r < opt.runs; ++r) {
          const Measured m = TimeOnce(call);
          ms.push_back(m.ms);
          peak = std::max(peak, m.extra_bytes);
        }
        std::sort(ms.begin(), ms.end());
        const double median = ms[ms.size() / 2];
        const float* o = static_cast<const float*>(buf.o());
        const int64_t count = buf.o_elements();
        if (is_ours) {
          ours_out.assign(o, o + count);
        } else {
          double diff = 0.0;
          for (int64_t i = 0; i < count; ++i)
            diff = std::max(diff, double{std::fabs(o[i] - ours_out[i])});
          if (!(diff < 1e-4)) {
            std::fprintf(stderr, "ours and naive disagree at N=%d causal=%d: max |diff| %g\n", n,
                         causal, diff);
            return 1;
          }
        }
        const double gflops = flops / (median * 1e-3) / 1e9;
        std::fprintf(out, "prefill,fp32,%d,%d,%d,%d,%d,%d,%d,%s,%.3f,%.2f,%.5f,,%lld,%d,%d\n",
                     p.head_dim, p.batch, p.num_heads_q, p.num_heads_kv, p.seqlen_q, p.seqlen_k,
                     causal ? 1 : 0, impl, median, gflops, gflops / 1e3,
                     static_cast<long long>(peak), opt.threads, opt.runs);
        std::fflush(out);
        std::fprintf(stderr, "N=%5d causal=%d %-5s %9.3f ms %7.2f GFLOP/s peak extra %lld B\n", n,
                     causal ? 1 : 0, impl, median, gflops, static_cast<long long>(peak));
      }
    }
  }
  if (out != stdout) std::fclose(out);
  return 0;
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) { return attnserve::Main(argc, argv); }
