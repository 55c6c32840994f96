#!/usr/bin/env bash
# On the GPU machine (no network; .device-carry/wheels carried): cuDNN's FP8
# SDPA forward (bench/gpu/cudnn_fp8_sdpa.py, through the carried
# nvidia-cudnn-frontend wheel) and, when $BUILD/bench/cuda/attn_bench exists,
# our attn_bench fp8 (and ours, BF16) rows on the prefill grid D 128, N 1k..16k,
# causal and not, in one call. Writes $OUT/fp8-peer-<gpu>-<date>.csv (copy it to
# bench/results/) and prints ours/cuDNN last.
# The wheel is installed into .device-carry/cudnn-fe with
# `pip install --target` (no venv, the system torch stays visible; falls back
# to unpacking the wheel, which is all the install does for this package).
# Usage: [BUILD=build-gpu] [BUILD_ATTN=1] [D=128] [N=1024,...] [O_DTYPE=fp8]
#        scripts/device/cudnn-fp8-bench.sh
# BUILD_ATTN=1 builds attn_bench in $BUILD when it is missing (cuda_build).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/cudnn-fp8-out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-gpu}
D=${D:-128}; N=${N:-1024,2048,4096,8192,16384}; O_DTYPE=${O_DTYPE:-fp8}
FE=$PWD/.device-carry/cudnn-fe
PY=${PYTHON:-python3}

whl=$(ls .device-carry/wheels/nvidia_cudnn_frontend-*-cp"$($PY -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"-*.whl 2>/dev/null | head -1)
if [ -z "$whl" ]; then
  echo "skipped: no nvidia_cudnn_frontend wheel for $($PY --version) in .device-carry/wheels" >&2
else
  rm -rf "$FE"
  if ! $PY -m pip install --no-deps --no-index --target "$FE" "$whl" >"$OUT/pip.log" 2>&1; then
    echo "pip --target failed (see $OUT/pip.log): unpacking the wheel instead" >&2
    $PY -m zipfile -e "$whl" "$FE" || exit 1
  fi
fi
export PYTHONPATH=$FE${PYTHONPATH:+:$PYTHONPATH}

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
slug=$(echo "$gpu" | tr '[:upper:]' '[:lower:]' | sed -E 's/nvidia //; s/[^a-z0-9]+/-/g; s/-+$//')
date=$(date +%Y-%m-%d)
res="$OUT/fp8-peer-$slug-$date.csv"
{
  echo "# gpu: $gpu; clocks (sm, max sm, mem MHz): $(nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader | head -1)"
  echo "# driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1); torch: $($PY -c 'import torch; print(torch.__version__, "cudnn", torch.backends.cudnn.version())' 2>/dev/null)"
  echo "# commit: ${ATTNSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}; date: $date; timing: CUDA events, L2 flushed, median of 25"
  echo "# cudnn_fp8: cuDNN SDPA_FP8 node (nvidia-cudnn-frontend $(basename "${whl:-none}" | cut -d- -f2)), E4M3 Q/K/V codes, descale 1, O $O_DTYPE;"
  echo "#   fp8: attn_bench's fp8 rows (E4M3 codes, descale 1, BF16 O); ours: attn_bench BF16; tflops counts attention FLOPs (causal halved)"
} >"$res"

$PY bench/gpu/cudnn_fp8_sdpa.py --d="$D" --n="$N" --o_dtype="$O_DTYPE" --csv="$OUT/cudnn-fp8.csv" 2>"$OUT/cudnn-fp8.log"
echo "cudnn_fp8_sdpa.py exit $?"
cat "$OUT/cudnn-fp8.log"
inputs=()
[ -s "$OUT/cudnn-fp8.csv" ] && inputs+=("$OUT/cudnn-fp8.csv")

use_carried_libs absl
if [ ! -x "$BUILD/bench/cuda/attn_bench" ] && [ "${BUILD_ATTN:-0}" = 1 ]; then
  cuda_build . "$BUILD" "$OUT/bbuild.log" attn_bench
fi
if [ -x "$BUILD/bench/cuda/attn_bench" ]; then
  # attn_bench's anchor grid (D 64/128/256, N 512..16k); the table keeps --d/--n's rows.
  "$BUILD/bench/cuda/attn_bench" --grid=anchor --dtypes=bf16 --impls="${IMPLS:-fp8,ours}" \
    --csv="$OUT/ours-fp8.csv" 2>"$OUT/attn_bench.log"
  echo "attn_bench exit $?"
  grep -E "SKIP|FAIL" "$OUT/attn_bench.log" | head -10
  [ -s "$OUT/ours-fp8.csv" ] && inputs+=("$OUT/ours-fp8.csv")
else
  echo "attn_bench not built in $BUILD (set BUILD=dir, or BUILD_ATTN=1 to build it): cuDNN rows only" >&2
fi

first=1
for f in "${inputs[@]}"; do
  if [ $first = 1 ]; then cat "$f"; first=0; else tail -n +2 "$f"; fi
done >>"$res"
echo "results: $res"
[ ${#inputs[@]} -gt 0 ] && $PY bench/gpu/cudnn_fp8_sdpa.py --compare "${inputs[@]}" | awk -v d="$D" 'NR == 1 || index(d, ",") || $1 == d'
exit 0
