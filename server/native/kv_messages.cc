// KvCache messages to core and pool types and back; see kv_messages.h.
#include "server/native/kv_messages.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/native/forward_call.h"
#include "server/native/kv_service.h"

namespace attnserve {

KvCreateCache DecodeCreateCache(const v1::CreateCacheRequest& r) {
  KvCreateCache c;
  c.geometry.num_layers = r.geometry().num_layers();
  c.geometry.num_heads_kv = r.geometry().num_heads_kv();
  c.geometry.head_dim = r.geometry().head_dim();
  c.geometry.dtype = static_cast<DType>(r.geometry().dtype());
  c.geometry.cache_dtype = static_cast<DType>(r.geometry().cache_dtype());
  c.geometry.head_dim_v = r.geometry().head_dim_v();
  c.geometry.v_in_k = r.geometry().v_in_k();
  c.page_size = r.page_size();
  c.capacity_tokens = r.capacity_tokens();
  c.capacity_bytes = r.capacity_bytes();
  c.cache_id = r.cache_id();
  if (r.has_device()) c.device = r.device();
  c.devices.assign(r.devices().begin(), r.devices().end());
  c.reserve = r.reserve();
  return c;
}

std::vector<KvSequenceSpec> DecodeSequences(const v1::CreateSequencesRequest& r) {
  std::vector<KvSequenceSpec> specs;
  for (const v1::SequenceSpec& s : r.sequences()) {
    KvSequenceSpec spec;
    spec.sequence_id = s.sequence_id();
    if (s.has_fork_from()) spec.fork_from = s.fork_from();
    if (s.has_fork_length()) spec.fork_length = s.fork_length();
    specs.push_back(spec);
  }
  return specs;
}

namespace {

// Reads a message's bytes where gRPC received them: a list of slices seen
// as one run of bytes.
class WireReader {
 public:
  explicit WireReader(std::vector<grpc::Slice> slices) : slices_(std::move(slices)) {
    size_t at = 0;
    for (const grpc::Slice& s : slices_) {
      starts_.push_back(at);
      at += s.size();
    }
    size_ = at;
  }
  size_t size() const { return size_; }

  // A varint at *pos (before `end`), *pos moved past it; false when cut off
  // or longer than ten bytes.
  bool Varint(size_t* pos, size_t end, uint64_t* value) {
    uint64_t v = 0;
    for (int i = 0; i < 10; ++i) {
      if (*pos >= end) return false;
      const uint8_t b = At((*pos)++);
      v |= uint64_t{b & 0x7fu} << (7 * i);
      if ((b & 0x80u) == 0) {
        *value = v;
        return true;
      }
    }
    return false;
  }
  // Moves *pos past the value of a field of wire type `wire_type`; false for
  // a value cut off by `end` or a group (left to protobuf).
  bool SkipValue(size_t* pos, size_t end, uint32_t wire_type) {
    uint64_t n = 0;
    switch (wire_type) {
      case 0: return Varint(pos, end, &n);
      case 1: n = 8; break;
      case 2:
        if (!Varint(pos, end, &n)) return false;
        break;
      case 5: n = 4; break;
      default: return false;
    }
    if (n > end - *pos) return false;
    *pos += n;
    return true;
  }
  // Copies [pos, pos + n) to `dst`, across slices.
  void CopyOut(size_t pos, size_t n, char* dst) {
    while (n > 0) {
      Locate(pos);
      const size_t take = std::min(n, cur_end_ - pos);
      std::memcpy(dst, slices_[cur_].begin() + (pos - cur_start_), take);
      dst += take;
      pos += take;
      n -= take;
    }
  }
  void Append(size_t pos, size_t n, std::string* out) {
    const size_t at = out->size();
    out->resize(at + n);
    CopyOut(pos, n, out->data() + at);
  }

 private:
  uint8_t At(size_t pos) {
    Locate(pos);
    return slices_[cur_].begin()[pos - cur_start_];
  }
  // Makes the slice holding byte `pos` (< size()) the current one.
  void Locate(size_t pos) {
    if (pos >= cur_start_ && pos < cur_end_) return;
    cur_ = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), pos) -
                               starts_.begin()) -
           1;
    cur_start_ = starts_[cur_];
    cur_end_ = cur_start_ + slices_[cur_].size();
  }

  std::vector<grpc::Slice> slices_;
  std::vector<size_t> starts_;
  size_t size_ = 0;
  size_t cur_ = 0, cur_start_ = 0, cur_end_ = 0;
};

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// Where the last data field of one tensor lies in the request (protobuf
// merges a tensor's occurrences: the last data wins).
struct DataAt {
  bool seen = false;
  size_t pos = 0, bytes = 0;
};

// The request without q's, k's and v's data (each tensor occurrence kept
// with its other fields, so presence and merging are protobuf's), and where
// each tensor's data lies; false for a form left to protobuf.
bool SplitTensorData(WireReader* in, std::string* rest, DataAt data[3]) {
  using R = v1::AppendAttendRequest;
  constexpr uint32_t kFields[3] = {R::kQFieldNumber, R::kKFieldNumber, R::kVFieldNumber};
  constexpr uint32_t kData = v1::Tensor::kDataFieldNumber;
  size_t pos = 0;
  const size_t end = in->size();
  while (pos < end) {
    const size_t field_at = pos;
    uint64_t tag = 0;
    if (!in->Varint(&pos, end, &tag) || (tag >> 3) == 0 || tag > 0xffffffffu) return false;
    const uint32_t field = static_cast<uint32_t>(tag >> 3), wire_type = tag & 7;
    const int tensor = static_cast<int>(std::find(kFields, kFields + 3, field) - kFields);
    if (tensor == 3 || wire_type != 2) {
      if (!in->SkipValue(&pos, end, wire_type)) return false;
      in->Append(field_at, pos - field_at, rest);
      continue;
    }
    uint64_t length = 0;
    if (!in->Varint(&pos, end, &length) || length > end - pos) return false;
    const size_t inner_end = pos + length;
    std::string body;
    while (pos < inner_end) {
      const size_t inner_at = pos;
      uint64_t inner_tag = 0;
      if (!in->Varint(&pos, inner_end, &inner_tag) || (inner_tag >> 3) == 0 ||
          inner_tag > 0xffffffffu) {
        return false;
      }
      if (inner_tag == (uint64_t{kData} << 3 | 2)) {
        uint64_t n = 0;
        if (!in->Varint(&pos, inner_end, &n) || n > inner_end - pos) return false;
        data[tensor] = {true, pos, static_cast<size_t>(n)};
        pos += n;
        continue;
      }
      if (!in->SkipValue(&pos, inner_end, inner_tag & 7)) return false;
      in->Append(inner_at, pos - inner_at, &body);
    }
    PutVarint(tag, rest);
    PutVarint(body.size(), rest);
    rest->append(body);
  }
  return true;
}

}  // namespace

// Declared in kv_service.h; defined beside the staged parse, which falls
// back to it, so that the two build alone (kv_staged_parse_fuzzer).
grpc::Status ParseAppendAttend(grpc::ByteBuffer* bytes, v1::AppendAttendRequest* request) {
  const grpc::Status status =
      grpc::SerializationTraits<v1::AppendAttendRequest>::Deserialize(bytes, request);
  bytes->Clear();  // already cleared by a successful parse; a failed one may not
  return status;
}

grpc::Status ParseAppendAttendStaged(grpc::ByteBuffer* bytes, const HostTensorAllocator& allocate,
                                     v1::AppendAttendRequest* request, KvStagedInputs* staged) {
  *staged = KvStagedInputs();
  std::vector<grpc::Slice> slices;
  if (!bytes->Dump(&slices).ok()) return ParseAppendAttend(bytes, request);
  WireReader in(std::move(slices));
  std::string rest;
  DataAt data[3];
  if (!SplitTensorData(&in, &rest, data) || !request->ParseFromString(rest)) {
    request->Clear();
    return ParseAppendAttend(bytes, request);
  }
  // Taken only for a tensor whose data was seen (so it was on the wire):
  // mutable_* on an absent one would make it present, unlike protobuf's parse
  // (found by kv_staged_parse_fuzzer).
  auto tensor_of = [request](int t) {
    return t == 0 ? request->mutable_q() : t == 1 ? request->mutable_k() : request->mutable_v();
  };
  std::shared_ptr<char>* places[3] = {&staged->q, &staged->k, &staged->v};
  int64_t* sizes[3] = {&staged->q_bytes, &staged->k_bytes, &staged->v_bytes};
  constexpr const char* kNames[3] = {"q", "k", "v"};
  grpc::Status status;
  for (int t = 0; t < 3 && status.ok(); ++t) {
    if (!data[t].seen || data[t].bytes == 0) continue;
    v1::Tensor* tensor = tensor_of(t);
    if (tensor->has_shm()) {
      // Both given: the span's check names the conflict with the data's size.
      tensor->mutable_data()->resize(data[t].bytes);
      in.CopyOut(data[t].pos, data[t].bytes, tensor->mutable_data()->data());
      continue;
    }
    std::shared_ptr<char> memory = allocate(static_cast<int64_t>(data[t].bytes));
    if (memory == nullptr) {
      status = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                            absl::StrCat(kNames[t], ".data: cannot allocate ", data[t].bytes,
                                         " bytes of host memory for it"));
      break;
    }
    in.CopyOut(data[t].pos, data[t].bytes, memory.get());
    *places[t] = std::move(memory);
    *sizes[t] = static_cast<int64_t>(data[t].bytes);
  }
  if (!status.ok()) *staged = KvStagedInputs();
  bytes->Clear();
  return status;
}

KvCall KvCallOf(const v1::AppendAttendRequest& r, CallMeta meta, const KvStagedInputs* staged) {
  KvCall call;
  call.meta = std::move(meta);
  call.meta.id = r.request_id();
  call.cache_id = r.cache_id();
  call.layer = r.layer();
  for (const v1::SequenceStep& s : r.sequences()) {
    call.steps.push_back(
        {s.sequence_id(), s.expected_length(), s.num_new_tokens(), s.num_queries(),
         absl::MakeConstSpan(s.attend_pages().data(), static_cast<size_t>(s.attend_pages_size()))});
  }
  call.q = ViewOf(r.q());
  call.k = ViewOf(r.k());
  call.v = ViewOf(r.v());
  int64_t staged_bytes = 0;
  if (staged != nullptr) {
    const std::pair<TensorView*, std::pair<const char*, int64_t>> parsed[] = {
        {&call.q, {staged->q.get(), staged->q_bytes}},
        {&call.k, {staged->k.get(), staged->k_bytes}},
        {&call.v, {staged->v.get(), staged->v_bytes}}};
    for (const auto& [view, place] : parsed) {
      if (place.first == nullptr) continue;
      view->bytes = absl::string_view(place.first, static_cast<size_t>(place.second));
      view->absent = false;
      staged_bytes += place.second;
    }
  }
  // Present when sent at all, so an empty scale tensor is still refused.
  if (r.has_k_scale()) {
    call.k_scale = ViewOf(r.k_scale());
    call.k_scale.absent = false;
  }
  if (r.has_v_scale()) {
    call.v_scale = ViewOf(r.v_scale());
    call.v_scale.absent = false;
  }
  call.options = OptionsOf(r.options());
  // Every option field reaches the checks: those K/V calls refuse are named.
  call.mods = ModsOf(r.options());
  // Parsed-out bytes are charged as the message's own were.
  call.request_bytes = static_cast<int64_t>(r.ByteSizeLong()) + staged_bytes;
  return call;
}

void FillAppendAttendResponse(KvResult* result, v1::AppendAttendResponse* response) {
  const OutputLayout& layout = result->layout;
  v1::Tensor* o = response->mutable_o();
  o->set_dtype(static_cast<v1::DType>(layout.o_dtype));
  for (int64_t d : layout.o_shape) o->add_shape(d);
  o->set_data(std::move(result->o));
  if (!layout.lse_shape.empty()) {
    v1::Tensor* lse = response->mutable_lse();
    lse->set_dtype(v1::FP32);
    for (int64_t d : layout.lse_shape) lse->add_shape(d);
    lse->set_data(std::move(result->lse));
  }
  for (int32_t len : result->lengths) response->add_lengths(len);
}

void FillCacheStats(const KvCacheStats& s, v1::CacheStats* out) {
  out->set_cache_id(s.cache_id);
  out->mutable_geometry()->set_num_layers(s.geometry.num_layers);
  out->mutable_geometry()->set_num_heads_kv(s.geometry.num_heads_kv);
  out->mutable_geometry()->set_head_dim(s.geometry.head_dim);
  out->mutable_geometry()->set_dtype(static_cast<v1::DType>(s.geometry.dtype));
  out->mutable_geometry()->set_cache_dtype(static_cast<v1::DType>(s.geometry.cache_dtype));
  out->mutable_geometry()->set_head_dim_v(s.geometry.head_dim_v);
  out->mutable_geometry()->set_v_in_k(s.geometry.v_in_k);
  out->set_page_size(s.page_size);
  out->set_device(s.device);
  out->set_capacity_pages(s.capacity_pages);
  out->set_pages_used(s.pages_used);
  out->set_pages_free(s.capacity_pages - s.pages_used);
  out->set_page_bytes(s.page_bytes);
  out->set_sequences(s.sequences);
  out->set_expired_sequences(s.expired_sequences);
  out->set_tokens(s.tokens);
}

}  // namespace attnserve
