// KServe v2 output delivery; see v2_outputs.h.
#include "server/kserve/v2_outputs.h"

#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"

namespace attnserve {

absl::Status PlanOutputs(const InputSource& source, const std::string& model, bool* return_lse,
                         std::vector<V2Output>* outputs) {
  const inference::ModelInferRequest& request = *source.request;
  if (request.outputs_size() == 0) {
    outputs->push_back({"o", std::nullopt, nullptr});
    if (*return_lse) outputs->push_back({"lse", std::nullopt, nullptr});
    return absl::OkStatus();
  }
  for (const auto& requested : request.outputs()) {
    const std::string where = absl::StrCat("outputs['", requested.name(), "']");
    if (requested.name() != "o" && requested.name() != "lse") {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": model '", model, "' has no such output (outputs: o, lse)"));
    }
    for (const V2Output& seen : *outputs) {
      if (seen.name == requested.name()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": requested twice"));
      }
    }
    if (requested.name() == "lse") *return_lse = true;
    absl::StatusOr<std::optional<ShmRef>> shm = ShmRefOf(where, requested.parameters());
    if (!shm.ok()) return shm.status();
    V2Output out{requested.name(), *shm, nullptr};
    if (out.shm.has_value()) {
      absl::StatusOr<std::shared_ptr<ShmRegion>> region =
          source.shm->Acquire(source.tenant, out.shm->region, out.shm->offset, out.shm->byte_size);
      if (!region.ok()) return region.status();
      out.region = *std::move(region);
    }
    outputs->push_back(std::move(out));
  }
  return absl::OkStatus();
}

absl::Status CheckOutputFits(const V2Output& out, uint64_t bytes) {
  if (!out.shm.has_value() || bytes <= out.shm->byte_size) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("outputs['", out.name, "']: shared memory region '", out.shm->region,
                   "' was given shared_memory_byte_size ", out.shm->byte_size, " for an output of ",
                   bytes, " bytes"));
}

absl::Status PlaceOutputs(std::vector<V2Output>* outputs, int64_t o_bytes, int64_t lse_bytes,
                          void** o, float** lse, OutputDevices* devices) {
  for (const V2Output& out : *outputs) {
    absl::Status fits =
        CheckOutputFits(out, static_cast<uint64_t>(out.name == "o" ? o_bytes : lse_bytes));
    if (!fits.ok()) return fits;
  }
  for (V2Output& out : *outputs) {
    if (out.region == nullptr) continue;
    const InPlaceBytes place =
        InPlace(out.region, *out.shm,
                devices != nullptr ? InPlaceKinds::kMappedOrDevice : InPlaceKinds::kMapped);
    if (place.data == nullptr) continue;
    out.in_place = true;
    if (out.name == "o") {
      *o = place.data;
      if (devices != nullptr) devices->o = place.device;
    } else {
      *lse = reinterpret_cast<float*>(place.data);
      if (devices != nullptr) devices->lse = place.device;
    }
  }
  return absl::OkStatus();
}

OutputSink V2Sink(std::vector<V2Output>* outputs, ProducedTensor* o, ProducedTensor* lse,
                  OutputDevices* devices) {
  return [outputs, o, lse, devices](const OutputLayout& layout, void** o_at, float** lse_at) {
    RETURN_IF_ERROR(PlaceOutputs(outputs, layout.o_bytes, layout.lse_bytes, o_at, lse_at, devices));
    o->dtype = layout.o_dtype;
    o->shape = layout.o_shape;
    lse->dtype = DType::kFP32;
    lse->shape = layout.lse_shape;
    try {
      if (*o_at == nullptr) {
        o->bytes.resize(static_cast<size_t>(layout.o_bytes));
        *o_at = o->bytes.data();
      }
      if (!layout.lse_shape.empty() && *lse_at == nullptr) {
        lse->bytes.resize(static_cast<size_t>(layout.lse_bytes));
        *lse_at = reinterpret_cast<float*>(lse->bytes.data());
      }
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError(
          absl::StrCat("outputs: cannot allocate ", layout.o_bytes + layout.lse_bytes,
                       " bytes of host memory for o", layout.lse_bytes > 0 ? " and lse" : ""));
    }
    return absl::OkStatus();
  };
}

absl::Status DeliverOutputs(std::vector<V2Output>* outputs, ProducedTensor* o, ProducedTensor* lse,
                            inference::ModelInferResponse* response) {
  auto tensor_of = [&](const std::string& name) { return name == "o" ? o : lse; };
  for (const V2Output& out : *outputs) {
    absl::Status fits = CheckOutputFits(out, tensor_of(out.name)->bytes.size());
    if (!fits.ok()) return fits;
    if (out.region != nullptr) RETURN_IF_ERROR(out.region->CheckIntact());
  }
  for (V2Output& out : *outputs) {
    ProducedTensor* tensor = tensor_of(out.name);
    auto* meta = response->add_outputs();
    meta->set_name(out.name);
    meta->set_datatype(DTypeName(tensor->dtype).data());
    for (int64_t d : tensor->shape) meta->add_shape(d);
    std::string* raw = response->add_raw_output_contents();
    if (out.region != nullptr) {
      // Empty, so raw_output_contents stays aligned with outputs.
      if (!out.in_place) {
        absl::Status written =
            out.region->Write(out.shm->offset, tensor->bytes.data(), tensor->bytes.size());
        if (!written.ok()) return written;
      }
      out.region.reset();
    } else {
      raw->swap(tensor->bytes);
    }
  }
  return absl::OkStatus();
}

void SetTimingParameters(const WorkTimings& t, const std::string& backend,
                         inference::ModelInferResponse* response) {
  auto& params = *response->mutable_parameters();
  params["queue_us"].set_int64_param(t.queue_us);
  params["compute_us"].set_int64_param(t.compute_us);
  params["total_us"].set_int64_param(t.total_us);
  params["batch_size"].set_int64_param(t.batch_size);
  params["device"].set_int64_param(t.device);
  params["backend"].set_string_param(backend);
}

}  // namespace attnserve
