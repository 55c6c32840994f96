#!/usr/bin/env bash
# On the GPU machine: bench/cuda/mask_bench (block-sparse masks, biases, ALiBi,
# sinks against the same shapes without them) and its peers on the same GPU
# (bench/gpu/mask_peers.py: FlexAttention compiled with the same block masks,
# SDPA with an attn_mask), merged into $OUT/masks-<gpu>-<date>.csv with a
# table printed last. Usage: [GRID=all|sparse|bias|mods] [IMPLS=ours,portable] [DIMS=64,128]
# [KERNELS=all|dev (dev: D 128 only, a faster build)] [ATTNSERVE_COMMIT=sha] scripts/device/mask-bench.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/mask-bench-out}
mkdir -p "$OUT"
GRID=${GRID:-all}; IMPLS=${IMPLS:-ours}; DIMS=${DIMS:-64,128}
KERNELS=${KERNELS:-all}
B=build-gpu
[ "$KERNELS" = dev ] && B=build-gpu-dev
use_carried_libs absl
if [ ! -f $B/build.ninja ]; then
  cmake -S . -B $B -G Ninja -DATTNSERVE_BUILD_SERVER=OFF -DATTNSERVE_CUDA=ON \
    -DCMAKE_PREFIX_PATH="$PWD/.device-carry/absl" -DCMAKE_CUDA_ARCHITECTURES=90-real \
    -DATTNSERVE_CUDA_KERNELS="$KERNELS" >"$OUT/mconfigure.log" 2>&1
fi
# Always: an incremental build after the tree changed.
ninja -C $B -j16 mask_bench >"$OUT/mbuild.log" 2>&1 || { tail -20 "$OUT/mbuild.log"; exit 1; }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
slug=$(echo "$gpu" | tr '[:upper:]' '[:lower:]' | sed -E 's/nvidia //; s/[^a-z0-9]+/-/g; s/-+$//')
date=$(date +%Y-%m-%d)
masks=$(mktemp -d)
{
  echo "# gpu: $gpu"
  echo "# driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1); nvcc: $(nvcc --version | tail -2 | head -1)"
  echo "# torch: $(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null)"
  echo "# commit: ${ATTNSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}; date: $date"
  echo "# mask_bench --grid=$GRID --impls=$IMPLS; peers: bench/gpu/mask_peers.py; CUDA events, L2 flushed, median of 15"
  echo "# bound = ms / (kept x plain ms) for sparse rows (target <= 1.15), ms / plain ms otherwise"
} >"$OUT/header.txt"
$B/bench/cuda/mask_bench --grid="$GRID" --impls="$IMPLS" --dims="$DIMS" --csv="$OUT/ours.csv" --mask_dir="$masks" 2>"$OUT/mask_bench.log"
echo "mask_bench rc=$?"; tail -3 "$OUT/mask_bench.log"
peer_args=()
[[ $GRID == all || $GRID == sparse ]] && peer_args+=(--mask_dir "$masks")
[[ $GRID == all || $GRID == bias ]] || peer_args+=(--skip_bias)
python3 bench/gpu/mask_peers.py "${peer_args[@]}" --csv "$OUT/peers.csv" 2>"$OUT/peers.log"
echo "mask_peers rc=$?"; tail -3 "$OUT/peers.log"
python3 bench/gpu/mask_table.py "$OUT/ours.csv" "$OUT/peers.csv" --header "$OUT/header.txt" \
  --out "$OUT/masks-$slug-$date.csv"
rm -rf "$masks"
