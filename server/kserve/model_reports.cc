// Metadata, config and statistics helpers of the v2 models; see model_reports.h.
#include "server/kserve/model_reports.h"

#include "server/kserve/model.h"

namespace attnserve {
namespace {

uint64_t Ns(int64_t us) { return static_cast<uint64_t>(us) * 1000; }

}  // namespace

void AddTensorMetadata(
    const char* name, const char* datatype, int rank,
    google::protobuf::RepeatedPtrField<inference::ModelMetadataResponse::TensorMetadata>* out) {
  auto* t = out->Add();
  t->set_name(name);
  t->set_datatype(datatype);
  for (int i = 0; i < rank; ++i) t->add_shape(-1);
}

inference::DataType ConfigType(DType t) {
  switch (t) {
    case DType::kFP16: return inference::TYPE_FP16;
    case DType::kBF16: return inference::TYPE_BF16;
    case DType::kFP32: return inference::TYPE_FP32;
    case DType::kFP8E4M3: break;  // not a v2 datatype (v2_tensors.cc refuses it)
  }
  return inference::TYPE_INVALID;
}

void AddConfigInput(const char* name, inference::DataType type, int rank, bool optional,
                    inference::ModelConfig* out) {
  inference::ModelInput* in = out->add_input();
  in->set_name(name);
  in->set_data_type(type);
  for (int i = 0; i < rank; ++i) in->add_dims(-1);
  in->set_optional(optional);
}

void AddConfigOutput(const char* name, inference::DataType type, int rank,
                     inference::ModelConfig* out) {
  inference::ModelOutput* o = out->add_output();
  o->set_name(name);
  o->set_data_type(type);
  for (int i = 0; i < rank; ++i) o->add_dims(-1);
}

void FillModelStatistics(const std::string& name, const ServerMetrics& metrics,
                         inference::ModelStatistics* out) {
  const ServerMetrics::Counters c = metrics.Snapshot();
  out->set_name(name);
  out->set_version(kModelVersion);
  out->set_last_inference(static_cast<uint64_t>(c.last_request_ms));
  out->set_inference_count(static_cast<uint64_t>(c.success));
  out->set_execution_count(static_cast<uint64_t>(c.executions));
  inference::InferStatistics* s = out->mutable_inference_stats();
  const uint64_t ok = static_cast<uint64_t>(c.success);
  s->mutable_success()->set_count(ok);
  s->mutable_success()->set_ns(Ns(c.request_us));
  // Durations of failed requests are not kept (as in Triton's metrics).
  s->mutable_fail()->set_count(static_cast<uint64_t>(c.failure));
  s->mutable_queue()->set_count(ok);
  s->mutable_queue()->set_ns(Ns(c.queue_us));
  s->mutable_compute_input()->set_count(ok);
  s->mutable_compute_input()->set_ns(Ns(c.compute_input_us));
  s->mutable_compute_infer()->set_count(ok);
  s->mutable_compute_infer()->set_ns(Ns(c.compute_infer_us));
  s->mutable_compute_output()->set_count(ok);
  s->mutable_compute_output()->set_ns(Ns(c.compute_output_us));
}

}  // namespace attnserve
