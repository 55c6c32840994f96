#!/usr/bin/env bash
# One `run` on the GPU machine: the full scripts/device/gpu-check.sh (build, CUDA
# tests, sanitizers, end-to-end against attnserve --backend=cuda), a decode
# split-count sweep (attn_bench --decode_splits), then scripts/device/gpu-bench.sh all
# in the time left under the 10-minute command limit.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
FINAL=${OUT:-$PWD/final-out}
# Work in a scratch folder: the device tool returns only a few files from
# $OUT, so logs go back as one tarball plus the merged CSV and the summaries.
OUT=$(mktemp -d)
trap 'cp "$OUT"/check.txt "$OUT"/bench.txt "$OUT"/bench/*-20*.csv "$FINAL"/ 2>/dev/null; tar -czf "$FINAL/logs.tar.gz" -C "$OUT" .' EXIT
mkdir -p "$FINAL"
t0=$(date +%s)
OUT="$OUT/check" scripts/device/gpu-check.sh >"$OUT/check.txt" 2>&1
sed -n '/==== gpu-check summary/,$p' "$OUT/check.txt"
use_carried_libs absl
B=build-gpu/bench/cuda/attn_bench
for s in 0 8 16 24 32 43 64 96; do
  timeout 60 $B --grid=decode --dtypes=bf16 --impls=ours --decode_splits=$s --csv="$OUT/split$s.csv" 2>/dev/null
done
python3 bench/gpu/tables.py splits "$OUT"
left=$((575 - ($(date +%s) - t0)))
echo "full bench: ${left}s left"
OUT="$OUT/bench" timeout "$left" scripts/device/gpu-bench.sh all >"$OUT/bench.txt" 2>&1
echo "gpu-bench rc=$? ($(( $(date +%s) - t0 )) s total)"
grep -E "^(pre|dec|config)" "$OUT/bench.txt" | cut -c1-84
