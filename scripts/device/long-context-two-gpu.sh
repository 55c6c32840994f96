#!/usr/bin/env bash
# On a two-GPU machine (device `run`, kind nvidia-h100-x2): one sequence decoding
# in a K/V cache that spans both GPUs (docs/kv-cache.md, "Caches that span
# devices") against the same sequence in a cache on one GPU. In process
# (tests/kv/long_context_bench: the K/V pool, one executor per GPU, no RPC):
# a step is one append-and-attend call per layer (1 token, 1 query, causal),
# layers in order; Hq 32, Hkv 8, D 128, BF16, pages of 64, 32 layers.
#   one-128k   one GPU, 131,072 tokens (17 GB of K/V)
#   two-128k   both GPUs, the same length
#   one-256k   one GPU, 262,144 tokens (34 GB: one H100 holds it)
#   two-256k   both GPUs with --kv_cache_gib=20 each, so neither GPU's pool
#              could hold the sequence alone (the target's case)
# Each run checks layer 0 of its last step against the float64 reference
# over the whole sequence (BF16 rule, backend/reference/tolerance.h). The
# target: two-GPU step <= 0.6x the one-GPU step at the same length.
# Rows go to $OUT/long-context.csv; the table is printed last, then where a
# layer-call's time went ($OUT/long-context-breakdown.csv, medians in us): per
# device the queue, copies in (the host's gather and the H2D copy), kernels
# and copies out (D2H and the scatter) as the backend's events time them; on
# the host the work before the launches (reserve, gather per device), the
# merge of the partials, and the rest (hand-offs between threads, waits).
# INLINE_MAX_COST (default the server's 4194304; 0 = never) is the executors'
# --inline_max_cost: with it a step's launches start on the calling thread.
# Expects .device-carry/bin/long_context_bench built with CUDA, with the
# libraries it loads in .device-carry/lib (as pack-device-deps.sh --server
# does for attnserve): from a CUDA build dir B,
#   ninja -C B long_context_bench && strip -o .device-carry/bin/long_context_bench B/tests/kv/long_context_bench
#   ldd .device-carry/bin/long_context_bench | awk '/=> \//{print $3}' | grep -vE '/(libc|libm|libdl|librt|libpthread|libresolv|ld-linux-x86-64|libgcc_s|libstdc\+\+)\.so' | xargs -r cp -L -t .device-carry/lib/
# Usage: [LAYERS=32] [STEPS=16] [INLINE_MAX_COST=4194304]
#        [CONFIGS="one-128k two-128k one-256k two-256k"]
#        scripts/device/long-context-two-gpu.sh
# Tried here on two CPU devices: BIN=build/tests/kv BACKEND=cpu SHORT=2048 LONG=4096
# GIB=1 LAYERS=2 scripts/device/long-context-two-gpu.sh (SHORT and LONG replace
# 131072 and 262144; GIB the per-device budgets).
# If 32 layers do not fit the call's time, LAYERS=8 measures fewer and the
# table scales the step to 32 layers (the layers run one after another, so
# a step is layers x the per-layer time; say so when reporting).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/long-context-out}
mkdir -p "$OUT"
bin=${BIN:-.device-carry/bin}/long_context_bench
use_carried_libs lib
layers=${LAYERS:-32}
steps=${STEPS:-16}
configs=" ${CONFIGS:-one-128k two-128k one-256k two-256k} "
csv=$OUT/long-context.csv
breakdown=$OUT/long-context-breakdown.csv
rm -f "$csv" "$breakdown"
nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm --format=csv >"$OUT/env.txt" 2>&1 || true
run() {  # run LABEL CONFIG CONTEXT GIB
  [[ $configs == *" $1 "* ]] || return 0
  echo "== $1" >&2
  timeout "${RUN_TIMEOUT:-200}" "$bin" --backend="${BACKEND:-cuda}" --config="$2" --context="$3" \
    --layers="$layers" --hq=32 --hkv=8 --d=128 --dtype=bf16 --page_size=64 --chunk=8192 \
    --steps="$steps" --warmup=2 --kv_cache_gib="$4" --csv="$csv" --label="$1" \
    --inline_max_cost="${INLINE_MAX_COST:-4194304}" --breakdown_csv="$breakdown" \
    >"$OUT/$1.txt" 2>&1
  local rc=$?
  cat "$OUT/$1.txt"
  [ $rc -eq 0 ] || echo "$1 failed (rc $rc)"
}
short=${SHORT:-131072}
long=${LONG:-262144}
run one-128k one "$short" "${GIB:-40}"
run two-128k two "$short" "${GIB:-40}"
run one-256k one "$long" "${GIB:-40}"
run two-256k two "$long" "${GIB:-20}"
[ -f "$csv" ] || { echo "no rows"; exit 1; }
python3 - "$csv" "$layers" "$breakdown" <<'PY'
import csv, sys
rows = {r["label"]: r for r in csv.DictReader(open(sys.argv[1]))}
layers = int(sys.argv[2])
scale = 32 / layers
print(f"{'config':<10} {'tokens':>8} {'GiB':>6} {'step ms':>9} {'us/layer':>9} {'32-layer ms':>12}  check")
for l, r in rows.items():
    p50 = float(r["step_ms_p50"])
    print(f"{l:<10} {int(r['context']):>8} {float(r['kv_gib']):>6.1f} {p50:>9.3f} "
          f"{float(r['us_per_layer']):>9.1f} {p50 * scale:>12.3f}  {r['check']}")
for n in ("128k", "256k"):
    one, two = rows.get("one-" + n), rows.get("two-" + n)
    if one and two:
        ratio = float(two["step_ms_p50"]) / float(one["step_ms_p50"])
        print(f"two/one at {n}: {ratio:.3f} (target <= 0.6: {'met' if ratio <= 0.6 else 'NOT met'})")
if layers != 32:
    print(f"measured {layers} layers; 32-layer ms scaled x{scale:g}")
try:
    parts = list(csv.DictReader(open(sys.argv[3])))
except OSError:
    parts = []
if parts:
    print("per layer-call, median us: wall = before + slowest device (queue+in+kernels+out) + merge + rest")
    print(f"{'config':<10} {'wall':>8} {'before':>7} {'merge':>6} {'rest':>7}  per device: queue/in/kernels/out")
    f = lambda x: float(x) if x not in ("", None) else 0.0
    for r in parts:
        devs = "  ".join(
            f"d{d} {f(r[f'queue_us_{d}']):.0f}/{f(r[f'in_us_{d}']):.0f}/{f(r[f'kernel_us_{d}']):.0f}/{f(r[f'out_us_{d}']):.0f}"
            for d in range(int(r["devices"])))
        print(f"{r['label']:<10} {f(r['wall_us']):>8.1f} {f(r['prepare_us']):>7.1f} "
              f"{f(r['merge_us']):>6.1f} {f(r['rest_us']):>7.1f}  {devs}")
PY
