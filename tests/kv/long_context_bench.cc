// Times decode steps over one long sequence in a K/V cache on one device and
// on a cache that spans two (docs/kv-cache.md, "Caches that span devices"),
// in process through the K/V pool and the executors (no RPC), and checks one
// layer's output against the float64 reference over the whole sequence.
// A step is one append-and-attend call per layer (1 new token, 1 query,
// causal), the layers one after another as a model runs them. The cache is
// filled append-only in chunks (no attention). Layer 0's rows are random,
// the other layers reuse them (their content does not change the time), and
// each query head looks hard at one planted key, spread over the sequence,
// so a wrong segment or merge moves O by far more than the tolerance.
// scripts/device/long-context-two-gpu.sh runs it on two GPUs.
//
// Usage: long_context_bench --backend=cuda|cpu --config=one|two --context=N
//   [--layers=32 --hq=32 --hkv=8 --d=128 --dtype=bf16 --page_size=64 --chunk=8192
//    --steps=16 --warmup=2 --kv_cache_gib=40 --csv=PATH --label=NAME --threads=0
//    --inline_max_cost=4194304 --breakdown_csv=PATH]
// Prints one line and where a layer-call's time went (per device: queue,
// copies in, kernels, copies out, as the backend times them; on the host:
// the work before the launches, the merge, and the rest); appends a CSV row
// to each file. Exit 1 on an error or a failed check.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "backend/backend_factory.h"
#include "backend/make_params.h"
#include "backend/reference/reference_attention.h"
#include "backend/reference/tolerance.h"
#include "common/dtype.h"
#include "server/executor.h"
#include "server/kv/kv_pool.h"

namespace attnserve {
namespace {

std::map<std::string, std::string> ParseArgs(int argc, char** argv) {
  std::map<std::string, std::string> a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    const size_t eq = s.find('=');
    if (s.rfind("--", 0) != 0 || eq == std::string::npos) {
      std::cerr << "expected --name=value, got " << s << "\n";
      std::exit(2);
    }
    a[s.substr(2, eq - 2)] = s.substr(eq + 1);
  }
  return a;
}

int64_t Int(const std::map<std::string, std::string>& a, const std::string& k, int64_t dflt) {
  auto it = a.find(k);
  int64_t v = dflt;
  if (it != a.end() && !absl::SimpleAtoi(it->second, &v)) {
    std::cerr << "--" << k << ": expected an integer, got " << it->second << "\n";
    std::exit(2);
  }
  return v;
}

std::string Str(const std::map<std::string, std::string>& a, const std::string& k,
                const std::string& dflt) {
  auto it = a.find(k);
  return it == a.end() ? dflt : it->second;
}

// xorshift: fast enough for a gigabyte of rows.
struct Rng {
  uint64_t s = 0x9e3779b97f4a7c15ull;
  float Next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return static_cast<float>(static_cast<int64_t>(s >> 40) - (int64_t{1} << 23)) /
           static_cast<float>(int64_t{1} << 23);
  }
};

struct Call {
  absl::Status status;
  std::string o, lse;
  // Where the call's time went: its wall time on this thread, the launch's
  // timings (one device) or each launch's and the host's (spanning).
  double wall_us = 0;
  WorkTimings timings;
  KvAppendAttend::SpanTimes span;
};

Call Run(KvPool& pool, const std::shared_ptr<KvCache>& cache, int32_t layer, uint64_t id,
         int32_t len, int32_t n, int32_t nq, const void* q, const void* k, const void* v,
         DType dtype, int hq, int hkv, int d) {
  auto c = std::make_shared<KvAppendAttend>();
  c->layer = layer;
  c->steps = {{id, len, n, nq}};
  c->dtype = dtype;
  c->num_heads_q = hq;
  c->num_heads_kv = hkv;
  c->head_dim = d;
  c->options.causal = true;
  c->inputs.q = q;
  c->inputs.k = k;
  c->inputs.v = v;
  c->return_lse = nq > 0;
  Call out;
  absl::Notification done;
  const auto t0 = std::chrono::steady_clock::now();
  const absl::Status s =
      pool.AppendAttend(cache, c, [&](const absl::Status& st, const WorkTimings& t) {
        out.status = st;
        out.timings = t;
        done.Notify();
      });
  if (!s.ok()) {
    out.status = s;
    return out;
  }
  done.WaitForNotification();
  out.wall_us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  out.o = std::move(c->o);
  out.lse = std::move(c->lse);
  out.span = std::move(c->span_times);
  return out;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Where a layer-call's time went (microseconds), per device
// from the backend's own timings (a GPU's from its events: kernels, copies
// in with the host's gather, copies out with the scatter) and on the host.
struct Breakdown {
  static constexpr int kDevices = 2;
  std::vector<double> wall, queue[kDevices], h2d[kDevices], kernel[kDevices], d2h[kDevices];
  std::vector<double> prepare, merge, rest;

  void Add(const Call& c, int n_devices) {
    double q[kDevices] = {}, in[kDevices] = {}, k[kDevices] = {}, out[kDevices] = {};
    auto add = [&](const WorkTimings& t) {
      const int d = std::min(std::max(t.device, 0), kDevices - 1);
      q[d] = std::max(q[d], double(t.queue_us));
      in[d] += double(t.host_to_device_us);
      k[d] += double(t.compute_us);
      out[d] += double(t.device_to_host_us);
    };
    if (c.span.launches.empty()) {
      add(c.timings);
    } else {
      for (const WorkTimings& t : c.span.launches) add(t);
    }
    double slowest = 0;
    for (int d = 0; d < n_devices; ++d) {
      queue[d].push_back(q[d]);
      h2d[d].push_back(in[d]);
      kernel[d].push_back(k[d]);
      d2h[d].push_back(out[d]);
      slowest = std::max(slowest, q[d] + in[d] + k[d] + out[d]);
    }
    wall.push_back(c.wall_us);
    prepare.push_back(double(c.span.prepare_us));
    merge.push_back(double(c.span.merge_us));
    rest.push_back(c.wall_us - slowest - double(c.span.prepare_us) - double(c.span.merge_us));
  }
};

int Main(int argc, char** argv) {
  const auto a = ParseArgs(argc, argv);
  const std::string backend_kind = Str(a, "backend", "cuda");
  const std::string config = Str(a, "config", "two");
  const int64_t context = Int(a, "context", 262144);
  const int layers = static_cast<int>(Int(a, "layers", 32));
  const int hq = static_cast<int>(Int(a, "hq", 32));
  const int hkv = static_cast<int>(Int(a, "hkv", 8));
  const int d = static_cast<int>(Int(a, "d", 128));
  const DType dtype = Str(a, "dtype", "bf16") == "fp16" ? DType::kFP16 : DType::kBF16;
  const int page_size = static_cast<int>(Int(a, "page_size", 64));
  const int64_t chunk = Int(a, "chunk", 8192);
  const int steps = static_cast<int>(Int(a, "steps", 16));
  const int warmup = static_cast<int>(Int(a, "warmup", 2));
  const int64_t budget = Int(a, "kv_cache_gib", 40) << 30;
  const std::string csv = Str(a, "csv", "");
  const std::string breakdown_csv = Str(a, "breakdown_csv", "");
  const std::string label = Str(a, "label", config);
  // The server's default (--inline_max_cost): a small call's launch starts
  // on the thread that submits it when its device is idle.
  const int64_t inline_max_cost = Int(a, "inline_max_cost", int64_t{1} << 22);

  BackendOptions bo;
  bo.kind = backend_kind;
  bo.cpu_devices = 2;
  bo.cpu_threads = static_cast<int>(Int(a, "threads", 0));
  absl::StatusOr<std::vector<std::unique_ptr<AttentionBackend>>> backends = MakeBackends(bo);
  if (!backends.ok()) {
    std::cerr << backends.status() << "\n";
    return 1;
  }
  const int n_devices = config == "two" ? 2 : 1;
  if (static_cast<int>(backends->size()) < n_devices) {
    std::cerr << "config " << config << " needs " << n_devices << " devices, the backend has "
              << backends->size() << "\n";
    return 1;
  }
  std::vector<std::unique_ptr<Executor>> executors;
  std::vector<KvDevice> devices;
  for (int i = 0; i < n_devices; ++i) {
    ExecutorOptions eo;
    eo.device = i;
    eo.inline_max_cost = inline_max_cost;
    executors.push_back(std::make_unique<Executor>((*backends)[size_t(i)].get(), eo));
    devices.push_back({(*backends)[size_t(i)].get(), executors.back().get(), i});
  }
  KvPoolOptions po;
  po.cache_bytes_per_device = budget;
  po.idle_timeout = absl::ZeroDuration();
  auto pool = std::make_unique<KvPool>(po, devices);
  KvCreateCache r;
  r.geometry = {layers, hkv, d, dtype};
  r.page_size = page_size;
  const int64_t total_tokens = (context + (warmup + steps) + page_size) * layers;
  r.capacity_tokens = total_tokens + int64_t{n_devices} * page_size * layers;
  if (n_devices == 2) {
    r.devices = {0, 1};
  } else {
    r.device = 0;
  }
  absl::StatusOr<std::shared_ptr<KvCache>> cache = pool->CreateCache("bench", r);
  if (!cache.ok()) {
    std::cerr << "create: " << cache.status() << "\n";
    return 1;
  }
  if (absl::Status s = (*cache)->CreateSequences({{1, {}, {}}}); !s.ok()) {
    std::cerr << s << "\n";
    return 1;
  }
  const int64_t row = int64_t{hkv} * d;  // elements of one K row
  const int64_t esize = DTypeSize(dtype);
  const int64_t rows_total = context + warmup + steps;
  // Layer 0's rows (the reference reads them), reused by every layer.
  std::vector<char> k(size_t(rows_total * row * esize)), v(k.size());
  Rng rng;
  for (int64_t i = 0; i < rows_total * row; ++i) {
    StoreFromFloat(k.data(), dtype, i, rng.Next());
    StoreFromFloat(v.data(), dtype, i, rng.Next());
  }
  const auto t_fill = std::chrono::steady_clock::now();
  for (int l = 0; l < layers; ++l) {
    for (int64_t at = 0; at < context; at += chunk) {
      const int32_t n = static_cast<int32_t>(std::min(chunk, context - at));
      const Call c =
          Run(*pool, *cache, l, 1, static_cast<int32_t>(at), n, 0, k.data(),
              k.data() + at * row * esize, v.data() + at * row * esize, dtype, hq, hkv, d);
      if (!c.status.ok()) {
        std::cerr << "fill layer " << l << " at " << at << ": " << c.status << "\n";
        return 1;
      }
    }
  }
  const double fill_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_fill).count();
  std::vector<std::string> shards;
  for (const KvShardStats& s : (*cache)->Stats().shards) {
    shards.push_back(absl::StrCat(s.device, ":", s.pages_used));
  }
  // Each head's query points at one key (a multiple of it), spread over the
  // sequence, on top of noise.
  std::vector<char> q(size_t(int64_t{hq} * d * esize));
  std::vector<float> qf(size_t(hq) * d);
  std::vector<double> step_ms;
  Breakdown parts;
  bool check_ok = true;
  std::string check = "not run";
  int32_t len = static_cast<int32_t>(context);
  for (int s = 0; s < warmup + steps; ++s) {
    for (int h = 0; h < hq; ++h) {
      const int64_t pos = (int64_t{h} + 1) * len / (hq + 1);
      const int kvh = h / (hq / hkv);
      for (int j = 0; j < d; ++j) {
        qf[size_t(h) * d + j] =
            0.2f * rng.Next() + 4.0f * LoadAsFloat(k.data(), dtype, (pos * hkv + kvh) * d + j);
        StoreFromFloat(q.data(), dtype, int64_t{h} * d + j, qf[size_t(h) * d + j]);
      }
    }
    const auto t0 = std::chrono::steady_clock::now();
    Call first;
    for (int l = 0; l < layers; ++l) {
      Call c = Run(*pool, *cache, l, 1, len, 1, 1, q.data(), k.data() + int64_t{len} * row * esize,
                   v.data() + int64_t{len} * row * esize, dtype, hq, hkv, d);
      if (!c.status.ok()) {
        std::cerr << "step " << s << " layer " << l << ": " << c.status << "\n";
        return 1;
      }
      if (s >= warmup) parts.Add(c, n_devices);
      if (l == 0) first = std::move(c);
    }
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    ++len;
    if (s >= warmup) step_ms.push_back(ms);
    if (s == warmup + steps - 1) {  // the last step, layer 0, against the reference
      AttnPointers io;
      io.q = q.data();
      io.k = k.data();
      io.v = v.data();
      AttnOptions opt;
      opt.causal = true;
      const AttnParams p = MakeAttnParams(DenseShape(dtype, 1, 1, len, hq, hkv, d), opt, io);
      const ReferenceOutput ref = ReferenceAttention(p);
      const ReferenceOutput low = ReferenceAttentionLowPrecision(p);
      double err = 0, low_err = 0, lse_err = 0, low_lse_err = 0, max_ref = 0;
      for (size_t i = 0; i < ref.o.size(); ++i) {
        err = std::max(err, std::fabs(LoadAsFloat(first.o.data(), dtype, int64_t(i)) - ref.o[i]));
        low_err = std::max(low_err, std::fabs(low.o[i] - ref.o[i]));
        max_ref = std::max(max_ref, std::fabs(ref.o[i]));
      }
      const float* lse = reinterpret_cast<const float*>(first.lse.data());
      for (size_t i = 0; i < ref.lse.size(); ++i) {
        lse_err = std::max(lse_err, std::fabs(lse[i] - ref.lse[i]));
        low_lse_err = std::max(low_lse_err, std::fabs(low.lse[i] - ref.lse[i]));
      }
      const double bound = 2 * low_err + tolerance::kBf16OutputFloor;
      const double lse_bound = 2 * low_lse_err + tolerance::kLowpLseFloor;
      check_ok = err <= bound && lse_err <= lse_bound;
      check = absl::StrCat(check_ok ? "PASS" : "FAIL", " max|o-ref| ", err, " (bound ", bound,
                           ", max|ref| ", max_ref, ") max|lse-ref| ", lse_err, " (bound ",
                           lse_bound, ")");
    }
  }
  std::vector<double> sorted = step_ms;
  std::sort(sorted.begin(), sorted.end());
  const double p50 = sorted.empty() ? 0 : sorted[sorted.size() / 2];
  double mean = 0;
  for (double x : step_ms) mean += x;
  mean = step_ms.empty() ? 0 : mean / double(step_ms.size());
  const double gb = double(context) * layers * row * esize * 2 / double(int64_t{1} << 30);
  std::string pages;
  for (const std::string& s : shards) absl::StrAppend(&pages, pages.empty() ? "" : " ", s);
  std::printf(
      "%s: %s devices=%d context=%lld layers=%d K/V %.1f GiB (pages per device %s) fill "
      "%.1f s; step p50 %.3f ms mean %.3f ms (%.1f us/layer); check %s\n",
      label.c_str(), backend_kind.c_str(), n_devices, static_cast<long long>(context), layers, gb,
      pages.c_str(), fill_s, p50, mean, 1000 * p50 / layers, check.c_str());
  if (!csv.empty()) {
    const bool fresh = !std::ifstream(csv).good();
    std::ofstream f(csv, std::ios::app);
    if (fresh) {
      f << "label,backend,devices,context,layers,hq,hkv,d,kv_gib,steps,step_ms_p50,step_ms_mean,"
           "us_per_layer,check\n";
    }
    f << label << "," << backend_kind << "," << n_devices << "," << context << "," << layers << ","
      << hq << "," << hkv << "," << d << "," << gb << "," << step_ms.size() << "," << p50 << ","
      << mean << "," << 1000 * p50 / layers << "," << (check_ok ? "PASS" : "FAIL") << "\n";
  }
  std::printf(
      "%s: per layer-call, median us: wall %.1f = host before the launches %.1f + slowest "
      "device's launch + merge %.1f + the rest %.1f (hand-offs, waits)\n",
      label.c_str(), Median(parts.wall), Median(parts.prepare), Median(parts.merge),
      Median(parts.rest));
  for (int dv = 0; dv < n_devices; ++dv) {
    std::printf(
        "%s:   device %d: queue %.1f, in %.1f (gather and copy), kernels %.1f, out %.1f "
        "(copy and scatter)\n",
        label.c_str(), dv, Median(parts.queue[dv]), Median(parts.h2d[dv]), Median(parts.kernel[dv]),
        Median(parts.d2h[dv]));
  }
  if (!breakdown_csv.empty()) {
    const bool fresh = !std::ifstream(breakdown_csv).good();
    std::ofstream f(breakdown_csv, std::ios::app);
    if (fresh) {
      f << "label,backend,devices,context,layers,wall_us,prepare_us,merge_us,rest_us";
      for (int dv = 0; dv < Breakdown::kDevices; ++dv) {
        f << ",queue_us_" << dv << ",in_us_" << dv << ",kernel_us_" << dv << ",out_us_" << dv;
      }
      f << "\n";
    }
    f << label << "," << backend_kind << "," << n_devices << "," << context << "," << layers << ","
      << Median(parts.wall) << "," << Median(parts.prepare) << "," << Median(parts.merge) << ","
      << Median(parts.rest);
    for (int dv = 0; dv < Breakdown::kDevices; ++dv) {
      if (dv < n_devices) {
        f << "," << Median(parts.queue[dv]) << "," << Median(parts.h2d[dv]) << ","
          << Median(parts.kernel[dv]) << "," << Median(parts.d2h[dv]);
      } else {
        f << ",,,,";
      }
    }
    f << "\n";
  }
  return check_ok ? 0 : 1;
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) { return attnserve::Main(argc, argv); }
