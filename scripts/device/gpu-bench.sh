#!/usr/bin/env bash
# On the GPU machine: attn_bench (standard, FA1 loop order, ours) and PyTorch
# SDPA (FLASH, CUDNN, EFFICIENT) on docs/design.md §5's grids in one run, merged
# into $OUT/<gpu>-<date>.csv (copy it to bench/results/) with ratios printed.
# Expects build-gpu from scripts/device/gpu-check.sh (or builds it).
# Usage: [DTYPES=bf16] [ATTNSERVE_COMMIT=sha] scripts/device/gpu-bench.sh [grid: all|anchor|decode|quick] [impls]
# (ATTNSERVE_COMMIT: the tree's commit when it was carried without .git.)
# quick = the reduced grid: D 64/128/256 at N 1k and 8k, causal and not, plus
# the decode grid (with DTYPES=bf16: ~1 minute on an H100).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/gpu-bench-out}
mkdir -p "$OUT"
GRID=${1:-all}; IMPLS=${2:-ours,standard,kvread,fa1}; DTYPES=${DTYPES:-bf16,fp16}
B=build-gpu
# The test binaries link the carried Abseil shared libraries.
use_carried_libs absl
if [ ! -x $B/bench/cuda/attn_bench ]; then
  cuda_build . $B "$OUT/bbuild.log" attn_bench || exit 1
fi
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
slug=$(echo "$gpu" | tr '[:upper:]' '[:lower:]' | sed -E 's/nvidia //; s/[^a-z0-9]+/-/g; s/-+$//')
date=$(date +%Y-%m-%d)
hdr="$OUT/header.txt"
{
  echo "# gpu: $gpu"
  echo "# clocks (sm, max sm, mem MHz): $(nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader | head -1)"
  echo "# driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1); nvcc: $(nvcc --version | tail -2 | head -1)"
  echo "# torch: $(python3 -c 'import torch; print(torch.__version__, "cudnn", torch.backends.cudnn.version())' 2>/dev/null)"
  echo "# commit: ${ATTNSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}; date: $date; timing: CUDA events, L2 flushed, median of 25 (ours/standard) 25 (sdpa) 20 (fa1)"
} >"$hdr"
# ours + standard first, then SDPA, then the slow FA1-order version (BF16, N <= 1k) last.
$B/bench/cuda/attn_bench --grid="$GRID" --dtypes="$DTYPES" --impls="${IMPLS/,fa1/}" --csv="$OUT/ours.csv" 2>"$OUT/attn_bench.log"
python3 bench/gpu/sdpa_bench.py --grid="$GRID" --dtypes="$DTYPES" --csv="$OUT/sdpa.csv" 2>"$OUT/sdpa.log"
inputs=("$OUT/ours.csv" "$OUT/sdpa.csv")
if [[ $IMPLS == *fa1* ]]; then
  timeout 150 $B/bench/cuda/attn_bench --grid=anchor --dtypes=bf16 --impls=fa1 --csv="$OUT/fa1.csv" 2>>"$OUT/attn_bench.log"
  inputs+=("$OUT/fa1.csv")
fi
python3 bench/gpu/merge_results.py "$OUT/$slug-$date.csv" "$hdr" "${inputs[@]}" | tee "$OUT/ratios.txt"
grep -E "SKIP|FAIL" "$OUT/attn_bench.log" | head -10 || true
