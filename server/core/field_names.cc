// The contract's field names; see field_names.h.
#include "server/core/field_names.h"

#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace attnserve {

std::string ContractDTypeName(int code) {
  switch (static_cast<DType>(code)) {
    case DType::kFP16:
    case DType::kBF16:
    case DType::kFP32:
    case DType::kFP8E4M3: return std::string(DTypeName(static_cast<DType>(code)));
  }
  return absl::StrCat("unknown dtype ", code);
}

std::string ContractOptionName(absl::string_view name) { return absl::StrCat("options.", name); }

std::string ContractStepField(int index, absl::string_view field) {
  return field.empty() ? absl::StrCat("sequences[", index, "]")
                       : absl::StrCat("sequences[", index, "].", field);
}

const FieldNames& ContractFieldNames() {
  static const FieldNames names;
  return names;
}

}  // namespace attnserve
