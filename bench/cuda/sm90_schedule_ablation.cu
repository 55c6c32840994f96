// LaunchForwardSm90Schedule (sm90_schedule_ablation.h): the D = 128 BF16
// Hopper kernel (either mask) under each warpgroup schedule, for attn_bench's
// ablation (bench/NOTES-cuda.md). kDefaultSm90Schedule runs the production
// library's own instantiation (extern template below), so its row times the
// kernel the server launches.
#include "backend/cuda/hopper/attn_fwd_sm90.cuh"
#include "bench/cuda/sm90_schedule_ablation.h"

namespace attnserve {
namespace cuda {

static_assert(kDefaultSm90Schedule == Sm90Schedule::kPersistentDynamic,
              "the extern templates below name the production schedule");
extern template cudaError_t RunAttnFwdSm90<128, __nv_bfloat16, false, kDefaultSm90Schedule, false,
                                           false>(const FwdLaunch&, cudaStream_t);
extern template cudaError_t RunAttnFwdSm90<128, __nv_bfloat16, true, kDefaultSm90Schedule, false,
                                           false>(const FwdLaunch&, cudaStream_t);

namespace {

template <bool kIsBanded>
cudaError_t RunSchedule(const FwdLaunch& l, Sm90Schedule schedule, cudaStream_t stream) {
  using T = __nv_bfloat16;
  switch (schedule) {
    case Sm90Schedule::kTmaSync:
      return RunAttnFwdSm90<128, T, kIsBanded, Sm90Schedule::kTmaSync>(l, stream);
    case Sm90Schedule::kWarpSpecialized:
      return RunAttnFwdSm90<128, T, kIsBanded, Sm90Schedule::kWarpSpecialized>(l, stream);
    case Sm90Schedule::kPingPong:
      return RunAttnFwdSm90<128, T, kIsBanded, Sm90Schedule::kPingPong>(l, stream);
    case Sm90Schedule::kPingPongOverlap:
      return RunAttnFwdSm90<128, T, kIsBanded, Sm90Schedule::kPingPongOverlap>(l, stream);
    case Sm90Schedule::kPersistent:
      return RunAttnFwdSm90<128, T, kIsBanded, Sm90Schedule::kPersistent>(l, stream);
    case Sm90Schedule::kPersistentDynamic:
      return RunAttnFwdSm90<128, T, kIsBanded, Sm90Schedule::kPersistentDynamic>(l, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LaunchForwardSm90Schedule(const AttnParams& dev, const Plan& plan,
                                      Sm90Schedule schedule, void* workspace, cudaStream_t stream) {
  if (plan.kernel_family != KernelFamily::kSm90 || plan.kernel_head_dim != 128 ||
      plan.tile_kind != TileKind::kPrefill || dev.dtype != DType::kBF16) {
    return cudaErrorInvalidValue;
  }
  // The schedule's own workspace (the plan's is its default schedule's).
  Plan p = plan;
  p.workspace_bytes = Sm90ScheduleWorkspaceBytes(schedule);
  const FwdLaunch l = MakeFwdLaunch(dev, p, workspace);
  return plan.banded ? RunSchedule<true>(l, schedule, stream)
                     : RunSchedule<false>(l, schedule, stream);
}

}  // namespace cuda
}  // namespace attnserve
