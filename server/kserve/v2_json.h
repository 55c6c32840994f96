// The KServe v2 HTTP/REST infer body (Triton's JSON, with the binary tensor
// extension) to and from the gRPC side's messages: a request body becomes an
// inference::ModelInferRequest, a ModelInferResponse becomes the response
// body. Only the body's syntax and the transport are checked here (types,
// nesting, JSON data packing, the binary blobs' bounds); the models check
// tensors against what they expect, as they do for gRPC. Used by
// http_service.cc; a function of bytes alone, so the fuzzer calls it too.
#pragma once

#include <cstddef>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "inference/grpc_service.pb.h"

namespace attnserve {

// The binary tensor extension's header: the length of the body's JSON part,
// the tensors' bytes following it.
inline constexpr char kInferHeaderContentLength[] = "Inference-Header-Content-Length";

// The deepest nesting of arrays and objects a request body may have: an
// inference request is an object of inputs holding data nested as deep as
// its rank. Checked before parsing, so nothing (the parser, the flattening,
// the document's destructor) recurses over a hostile depth.
inline constexpr int kMaxJsonDepth = 64;

// OK unless `text`'s arrays and objects nest deeper than kMaxJsonDepth.
// Brackets inside strings do not count.
absl::Status CheckJsonDepth(absl::string_view text);

// `object[name]` as a string; INVALID_ARGUMENT naming `where`.`name` otherwise.
absl::StatusOr<std::string> StringField(const std::string& where, const nlohmann::json& object,
                                        const char* name);

// Which requested outputs want binary data, and which go to shared memory.
struct OutputForm {
  bool default_binary = false;
  std::set<std::string> binary;
  std::set<std::string> json;
  std::set<std::string> shm;
};

// The JSON header plus binary blobs of an infer call -> `out` (inputs with
// JSON data or binary blobs get a raw_input_contents entry each, in order;
// inputs in shared memory none) and `form`. `header_length` is the value of
// the Inference-Header-Content-Length header when the request has one (the
// whole body is JSON otherwise). INVALID_ARGUMENT naming the field otherwise.
absl::Status ParseInferBody(absl::string_view body, std::optional<absl::string_view> header_length,
                            inference::ModelInferRequest* out, OutputForm* form);

// A response body: the JSON header, followed by the binary outputs' bytes
// when there are any (then `header_length` is set: the value of
// Inference-Header-Content-Length, and the body is application/octet-stream).
struct EncodedInferResponse {
  std::string body;
  std::optional<size_t> header_length;
};

// `r` as the v2 JSON response, each output in the form `form` asks for.
// Throws nlohmann::json's type_error when a string is not valid UTF-8.
EncodedInferResponse EncodeInferResponse(const inference::ModelInferResponse& r,
                                         const OutputForm& form);

}  // namespace attnserve
