#!/usr/bin/env bash
# Tuning round on the GPU machine (one `run`): build + CUDA tests (no
# sanitizers, no e2e) via scripts/device/gpu-check.sh, then the reduced (quick) grid,
# bf16: ours, SDPA FLASH/CUDNN and, for decode, the kvread floor (a plain read
# of the K/V bytes), with a ratio table last. For an A/B of a tile candidate,
# build the candidate behind a temporary switch and set ALT_ENV (e.g.
# ALT_ENV=MY_SWITCH=1): tests and the grid then also run with it ("alt").
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/ab-out}
mkdir -p "$OUT"
use_carried_libs absl
OUT="$OUT/check" scripts/device/gpu-check.sh --no-sanitizer --no-e2e 2>&1 | tail -8
B=build-gpu/bench/cuda/attn_bench
$B --grid=quick --dtypes=bf16 --impls=ours,kvread --csv="$OUT/ours.csv" 2>"$OUT/ours.log"
if [ -n "${ALT_ENV:-}" ]; then
  env "$ALT_ENV" build-gpu/tests/cuda/cuda_backend_test >"$OUT/tests-alt.log" 2>&1
  echo "alt tests: rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests-alt.log" | tr '\n' ' ')"
  env "$ALT_ENV" $B --grid=quick --dtypes=bf16 --impls=ours --csv="$OUT/alt_all.csv" 2>"$OUT/alt.log"
fi
python3 bench/gpu/sdpa_bench.py --grid=quick --dtypes=bf16 --csv="$OUT/sdpa.csv" 2>"$OUT/sdpa.log"
python3 bench/gpu/tables.py ab "$OUT"
