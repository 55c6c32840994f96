#!/usr/bin/env bash
# On the GPU machine: one pass of the Hopper kernel checks and benchmarks in one
# device call: scripts/device/gpu-check.sh (build, the CUDA tests on the Hopper and
# the portable family, the SASS check, sanitizers unless --no-sanitizer), then
# scripts/device/gpu-bench.sh on GRID (default quick) with ours, portable and the
# five Hopper schedules (the ablation at D=128 BF16 non-causal) next to SDPA.
# Usage: [GRID=anchor] [DTYPES=bf16] bench/gpu/sm90_round.sh [--no-sanitizer]
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$PWD/sm90-round-out}
export OUT
mkdir -p "$OUT"
scripts/device/gpu-check.sh --no-e2e "$@" >"$OUT/check.txt" 2>&1
DTYPES=${DTYPES:-bf16} scripts/device/gpu-bench.sh "${GRID:-quick}" ours,portable,sm90_tma,sm90_ws,sm90_pp,sm90_ppo,sm90_persist \
  >"$OUT/bench.txt" 2>&1
grep -A40 '==== gpu-check summary' "$OUT/check.txt"
cat "$OUT/bench.txt"
