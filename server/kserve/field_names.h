// KServe v2's names for the fields the core checks: `inputs['q'].shape`,
// `inputs['q'].datatype`, `parameters['causal']`, `parameters['layer']`.
#pragma once

#include "server/core/field_names.h"

namespace attnserve {

const FieldNames& V2FieldNames();

}  // namespace attnserve
