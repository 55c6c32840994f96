// The native API's field names; see field_names.h.
#include "server/native/field_names.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve {
namespace {

// The enum's own names, DTYPE_UNSPECIFIED included.
std::string WireDTypeName(int code) {
  const std::string& name = v1::DType_Name(static_cast<v1::DType>(code));
  return name.empty() ? absl::StrCat("unknown dtype ", code) : name;
}

}  // namespace

const FieldNames& NativeFieldNames() {
  static const FieldNames names = [] {
    FieldNames n;  // the contract's names are the native API's
    n.dtype_name = WireDTypeName;
    return n;
  }();
  return names;
}

}  // namespace attnserve
