// The native API's (attnserve.v1) names for the fields the core checks:
// `q.shape`, `options.causal`, `sequences[2].expected_length`.
#pragma once

#include "server/core/field_names.h"

namespace attnserve {

const FieldNames& NativeFieldNames();

}  // namespace attnserve
