// The split count a forward launch runs, which may be fewer than its plan
// holds. Plain C++ (attn_fwd_plan.cc; the CPU tests call it too), apart from
// attn_fwd_plan.h so the kernels, which never need it, do not include it.
#pragma once

#include "backend/params.h"
#include "backend/plan.h"

namespace attnserve {
namespace cuda {

// MakeFwdLaunch's split count for `plan` over `p`: plan.num_splits, except
// under batch-invariant decode. There the plan holds S splits
// (InvariantDecodeSplits; its workspace), the same for calls of any length,
// so they plan alike and the executor packs them (SamePlanned); the launch
// runs InvariantDecodeGrid of p's longest sequence (at most S, at least 2),
// enough for every sequence in it.
int LaunchSplits(const AttnParams& p, const Plan& plan);

}  // namespace cuda
}  // namespace attnserve
