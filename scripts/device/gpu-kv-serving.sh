#!/usr/bin/env bash
# On the GPU machine (device `run`, with .device-carry carried: a server built
# with CUDA, scripts/device/pack-device-deps.sh --server BUILD_DIR): the K/V service
# benchmark, every side in one run on one host, one GPU.
#   attnserve_kv         attnctl load-kv: prefill, then per token and layer one
#                        append-and-attend step per group of sequences (Sq = 1)
#   attnserve_stateless  the same loop sending the whole context with Forward
#   torch_local          bench/gpu/kv_torch_local.py: the in-process PyTorch
#                        loop (appends + SDPA over a preallocated cache), the
#                        local ceiling
# Shapes: Hq 32, Hkv 8, D 128, BF16. 64 sequences x 8k context at 1 layer
# (unary, and streams with 4 groups in flight) and at 32 layers (65 GiB of
# pages, prefilled append-only: --prefill_attend=false), 16 x 4k at 1 layer
# for the stateless comparison, and the Echo RPC carrying one 64-sequence
# decode step's bytes (q [64,1,32,128], k/v [64,1,8,128]) at concurrency 1:
# the per-step overhead is the unary step's p50 - its kernel - Echo's p50. Rows go to $OUT/kv-loop.csv (load-kv's columns);
# the table is printed last.
# Usage: scripts/device/gpu-kv-serving.sh [TOKENS]   (generated tokens per sequence, default 16)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/gpu-kv-out}
mkdir -p "$OUT"
tokens=${1:-16}
bin=.device-carry/bin
use_carried_libs lib
csv=$OUT/kv-loop.csv
rm -f "$csv" "$OUT/torch-local.csv" "$OUT/torch-local.err"
{
  nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv
  python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  echo "cpus $(nproc)"
} >"$OUT/env.txt" 2>&1

port=50061
pid=""
trap '[ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null; wait' EXIT
start_server "$OUT/attnserve.log" 60 "$bin/attnctl" --target="127.0.0.1:$port" -- \
  "$bin/attnserve" --backend=cuda --host=127.0.0.1 --port="$port" --log_level=warn \
  --metrics_port=0 --http_port=0 --devices=0 --kv_cache_bytes=$((74 << 30)) ||
  exit 1
pid=$SERVER_PID
ctl=("$bin/attnctl" --target="127.0.0.1:$port" --timeout=600s)
shape=(--heads_q=32 --heads_kv=8 --head_dim=128 --dtype=bf16)
paged=(--page_size=64)

# Correctness first: a short decode loop with every output checked.
if "${ctl[@]}" load-kv --sequences=4 --prompt=300 --tokens=4 --layers=2 "${shape[@]}" "${paged[@]}" --check \
  >"$OUT/check.txt" 2>&1; then
  echo "check: PASS"
else
  echo "check: FAIL"; tail -20 "$OUT/check.txt"
fi

run() {  # run LABEL FLAGS...: one load-kv configuration, rows appended to $csv
  local label=$1; shift
  echo "== $label" >&2
  timeout "${RUN_TIMEOUT:-240}" "${ctl[@]}" load-kv "${shape[@]}" --csv="$csv" --label="$label" "$@" \
    >"$OUT/$label.txt" 2>&1 || { echo "$label failed:"; tail -5 "$OUT/$label.txt"; }
}
run kv64x8k-unary "${paged[@]}" --sequences=64 --prompt=8192 --tokens="$tokens" --warmup_tokens=2 --layers=1
run kv64x8k-stream4 "${paged[@]}" --sequences=64 --prompt=8192 --tokens="$tokens" --warmup_tokens=2 --layers=1 \
  --stream --channels=4 --concurrency=4
run kv16x4k "${paged[@]}" --sequences=16 --prompt=4096 --tokens="$tokens" --warmup_tokens=2 --layers=1
run stateless16x4k --stateless --sequences=16 --prompt=4096 --tokens=4 --warmup_tokens=1 --layers=1
# 32 layers: each token is 32 layer-steps over 2.1 GB of K/V each.
RUN_TIMEOUT=400 run kv64x8k-32layers "${paged[@]}" --sequences=64 --prompt=8192 --tokens="$tokens" --warmup_tokens=2 \
  --layers=32 --prefill_attend=false --stream --channels=4 --concurrency=1,4
echo "== echo64" >&2
timeout 120 "${ctl[@]}" load --rpc=echo --batch=64 --seqlen_q=1 --seqlen_k=1 "${shape[@]}" \
  --concurrency=1 --warmup=2s --duration=10s --csv="$OUT/echo.csv" --label=echo64 \
  >"$OUT/echo64.txt" 2>&1 || { echo "echo64 failed:"; tail -5 "$OUT/echo64.txt"; }
kill -TERM "$pid"; wait "$pid"; pid=""

for sdpa in cudnn flash; do
  python3 bench/gpu/kv_torch_local.py --sdpa="$sdpa" --sequences=64 --context=8192 --layers=1,32 \
    --steps=32 >>"$OUT/torch-local.csv" 2>>"$OUT/torch-local.err" || tail -5 "$OUT/torch-local.err"
  python3 bench/gpu/kv_torch_local.py --sdpa="$sdpa" --sequences=16 --context=4096 --layers=1 \
    --steps=32 >>"$OUT/torch-local.csv" 2>>"$OUT/torch-local.err" || tail -5 "$OUT/torch-local.err"
done

echo "--- results (tokens/s, per-step p50/p99 ms)"
cat "$csv" "$OUT/torch-local.csv" 2>/dev/null
echo "--- Echo of one 64-sequence decode step's bytes (concurrency 1)"
cat "$OUT/echo.csv" 2>/dev/null
