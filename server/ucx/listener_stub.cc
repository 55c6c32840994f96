// The UCX listener of a build without UCX (cmake/ucx.cmake): Start says so,
// and the server refuses --ucx_port with that message.
#include "server/ucx/listener.h"

namespace attnserve {
namespace ucx {

class Listener::Impl {};

absl::StatusOr<std::unique_ptr<Listener>> Listener::Start(const ListenerOptions&, StepHandler*) {
  return absl::FailedPreconditionError("ucx_port: this attnserve was built without UCX");
}

Listener::~Listener() = default;

void Listener::Stop(absl::Duration) {}

}  // namespace ucx
}  // namespace attnserve
