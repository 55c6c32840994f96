// Per-step CPU of the encodings the K/V unary step changed, at the GPU loop's bytes
// (q 512 KiB, k/v 128 KiB each, o 512 KiB), old and new alternated, medians.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "absl/time/clock.h"
#include "client/inputs.h"
#include "client/kv_client.h"
#include "common/malloc_tuning.h"
#include "common/tensor_wire_slices.h"
using namespace attnserve;
static double Med(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
int main(int argc, char** argv) {
  TuneMallocForTensors();  // as attnctl and attnserve do
  const int N = argc > 1 ? atoi(argv[1]) : 2000;
  std::mt19937_64 rng(1);
  // argv[2]: distinct inputs cycled through (64: 80 MiB, out of the caches).
  const int P = argc > 2 ? atoi(argv[2]) : 1;
  std::vector<HostTensor> qs, ks, vs;
  std::vector<std::string> os;
  for (int p = 0; p < P; ++p) {
    qs.push_back(RandomTensor(DType::kBF16, {64, 32, 128}, &rng));
    ks.push_back(RandomTensor(DType::kBF16, {64, 8, 128}, &rng));
    vs.push_back(RandomTensor(DType::kBF16, {64, 8, 128}, &rng));
    os.push_back(qs.back().bytes());
  }
  const size_t ob = os[0].size();
  std::vector<double> req_old, req_new, resp_old, resp_new;
  bool own;
  for (int i = 0; i < N; ++i) {
    AppendAttendInputs in;
    in.cache_id = "c-0123456789abcdef";
    for (int s = 0; s < 64; ++s) in.sequences.push_back({uint64_t(s), 100 + i, 1, 1});
    const HostTensor& q = qs[i % P];
    const std::string& o_src = os[(i + P / 2) % P];
    in.q = q;
    in.k = ks[i % P];
    in.v = vs[i % P];
    v1::AppendAttendRequest req = MakeAppendAttendRequest(std::move(in));
    v1::AppendAttendRequest req2 = req;
    // Client request: the stub's serialization (old) vs the slices (new); each buffer freed.
    absl::Time a = absl::Now();
    {
      grpc::ByteBuffer bb;
      grpc::SerializationTraits<v1::AppendAttendRequest>::Serialize(req, &bb, &own);
    }
    absl::Time b = absl::Now();
    {
      TensorWireSlices t;
      t.TakeData(5, req2.mutable_q()->mutable_data());
      t.TakeData(6, req2.mutable_k()->mutable_data());
      t.TakeData(7, req2.mutable_v()->mutable_data());
      grpc::ByteBuffer bb = t.Encode(req2);
    }
    absl::Time c = absl::Now();
    // Server response: zero-filled string written by the kernel, serialized (old) vs an
    // uninitialised buffer written by the kernel and shared as a slice (new).
    {
      v1::AppendAttendResponse r;
      std::string o;
      o.resize(ob);
      memcpy(&o[0], o_src.data(), ob);  // the kernel's write
      r.mutable_o()->set_dtype(v1::BF16);
      for (int d : {64, 32, 128}) r.mutable_o()->add_shape(d);
      r.mutable_o()->set_data(std::move(o));
      for (int s = 0; s < 64; ++s) r.add_lengths(s);
      grpc::ByteBuffer bb;
      grpc::SerializationTraits<v1::AppendAttendResponse>::Serialize(r, &bb, &own);
    }
    absl::Time d = absl::Now();
    {
      v1::AppendAttendResponse r;
      std::shared_ptr<char> o(new char[ob], std::default_delete<char[]>());
      memcpy(o.get(), o_src.data(), ob);  // the kernel's write
      r.mutable_o()->set_dtype(v1::BF16);
      for (int d : {64, 32, 128}) r.mutable_o()->add_shape(d);
      for (int s = 0; s < 64; ++s) r.add_lengths(s);
      TensorWireSlices t;
      t.ShareData(2, std::move(o), ob);
      grpc::ByteBuffer bb = t.Encode(r);
    }
    absl::Time e = absl::Now();
    if (i >= N / 10) {
      req_old.push_back(absl::ToDoubleMicroseconds(b - a));
      req_new.push_back(absl::ToDoubleMicroseconds(c - b));
      resp_old.push_back(absl::ToDoubleMicroseconds(d - c));
      resp_new.push_back(absl::ToDoubleMicroseconds(e - d));
    }
  }
  printf("inputs cycled %d: client request encode", P);
  printf(" (768 KiB of q/k/v): old %.1f us, new %.1f us (median of %zu)\n", Med(req_old),
         Med(req_new), req_old.size());
  printf("server o: fill + write + encode (512 KiB):  old %.1f us, new %.1f us\n", Med(resp_old),
         Med(resp_new));
}
