// Bulk K/V chunks over UCX in a build without UCX: never offered (the
// import answers why, and the chunks go in the gRPC stream).
#include "server/ucx/kv_bulk.h"

namespace attnserve {
namespace ucx {
namespace {
absl::Status NotBuilt() {
  return absl::UnimplementedError("this attnserve was built without UCX (docs/ucx.md)");
}
}  // namespace

bool BulkBuilt() { return false; }
PinHost DefaultPinHost() { return nullptr; }

class BulkReceiver::Impl {
 public:
  BulkOffer offer;
};

BulkReceiver::BulkReceiver(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BulkReceiver::~BulkReceiver() = default;
absl::StatusOr<std::unique_ptr<BulkReceiver>> BulkReceiver::Start(const std::string&, Apply,
                                                                  const BulkOptions&) {
  return NotBuilt();
}
const BulkOffer& BulkReceiver::offer() const { return impl_->offer; }
void BulkReceiver::Stop() {}
int64_t BulkReceiver::chunks() const { return 0; }
int64_t BulkReceiver::bytes() const { return 0; }
int64_t BulkReceiver::buffered_bytes() const { return 0; }
int64_t BulkReceiver::discarded() const { return 0; }

absl::Status SendChunks(const BulkOffer&, const NextChunk&, const BulkOptions&,
                        const std::atomic<bool>*, BulkSendResult*) {
  return NotBuilt();
}

}  // namespace ucx
}  // namespace attnserve
