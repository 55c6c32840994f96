// What every KServe v2 model reports alike: tensor entries of its metadata
// and config, and its statistics from the server-wide counters that /metrics
// keeps (model.h).
#pragma once

#include "backend/params.h"
#include "inference/grpc_service.pb.h"
#include "inference/model_config.pb.h"
#include "server/metrics.h"

namespace attnserve {

// A metadata tensor entry with `rank` dimensions of -1.
void AddTensorMetadata(
    const char* name, const char* datatype, int rank,
    google::protobuf::RepeatedPtrField<inference::ModelMetadataResponse::TensorMetadata>* out);
// The config's data type for a float dtype.
inference::DataType ConfigType(DType t);
// Config input / output entries with `rank` dimensions of -1.
void AddConfigInput(const char* name, inference::DataType type, int rank, bool optional,
                    inference::ModelConfig* out);
void AddConfigOutput(const char* name, inference::DataType type, int rank,
                     inference::ModelConfig* out);

// ModelStatistics of model `name` from the server's counters (every model
// reports the same numbers); failed requests have counts, not durations.
void FillModelStatistics(const std::string& name, const ServerMetrics& metrics,
                         inference::ModelStatistics* out);

}  // namespace attnserve
