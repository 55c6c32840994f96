// LaunchForwardSm90Schedule (attn_fwd_sm90.h): the D = 128 BF16 unbanded
// Hopper kernel under each warpgroup schedule, for attn_bench's ablation
// (bench/NOTES-cuda.md). Production launches use DefaultSm90Schedule only.
#include "backend/cuda/hopper/attn_fwd_sm90.cuh"

namespace attnserve {
namespace cuda {

cudaError_t LaunchForwardSm90Schedule(const AttnParams& dev, const Plan& plan,
                                      Sm90Schedule schedule, cudaStream_t stream) {
  if (plan.kernel_family != KernelFamily::kSm90 || plan.kernel_head_dim != 128 || plan.banded ||
      dev.dtype != DType::kBF16) {
    return cudaErrorInvalidValue;
  }
  const FwdLaunch l = MakeFwdLaunch(dev, plan, nullptr);
  switch (schedule) {
    case Sm90Schedule::kTmaSync:
      return RunAttnFwdSm90<128, __nv_bfloat16, false, Sm90Schedule::kTmaSync>(l, stream);
    case Sm90Schedule::kWarpSpecialized:
      return RunAttnFwdSm90<128, __nv_bfloat16, false, Sm90Schedule::kWarpSpecialized>(l, stream);
    case Sm90Schedule::kPingPong:
      return RunAttnFwdSm90<128, __nv_bfloat16, false, Sm90Schedule::kPingPong>(l, stream);
    case Sm90Schedule::kPingPongOverlap:
      return RunAttnFwdSm90<128, __nv_bfloat16, false, Sm90Schedule::kPingPongOverlap>(l, stream);
    case Sm90Schedule::kPersistent:
      return RunAttnFwdSm90<128, __nv_bfloat16, false, Sm90Schedule::kPersistent>(l, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace attnserve
