#!/usr/bin/env bash
# On the GPU machine (device `run`, with .device-carry carried): MLA-shape
# prefill (Q/K head dim 192, V/O 128: DeepSeek-V3's). Builds the CUDA
# backend's MLA tests and bench/cuda/mla_prefill_bench (server off, as
# scripts/device/fp8-kv-bench.sh does); runs cuda_mla_prefill_test on the
# plan's kernels (Hopper where it covers a case), then all on the portable
# kernel, and cuda_mla_refusal_test; with REGRESS=1 the portable kernels' own
# tests (the body the value dim went into: cuda_backend_test without its
# Hopper and FP8 suites, cuda_score_mods_test); compute-sanitizer memcheck,
# racecheck and synccheck on a few MLA cases. Then times our 192/128 prefill
# (the plan's kernel, and the portable one beside it) at N 1k-16k with
# B x N = 16k tokens, Hq 128 and 16 (K/V heads = query heads), causal and
# not, against PyTorch SDPA on the same GPU (bench/gpu/mla_sdpa_bench.py:
# each backend on the shape as it is where it takes Dv != Dqk, else with V
# zero-padded to 192). TFLOP/s counts 2 x B x H x N x N x (Dqk + Dv), halved
# for causal, for every row. Prints a summary and one table (ours against
# the fastest SDPA row per shape); CSV and logs under $OUT.
# Usage: [KERNELS=dev|all (all: also the equal-dims D 192 rows, --same_dims)]
#   [BUILD=dir] [DTYPES="bf16 fp16"] [NS=1024,...] [HQS=128,16] [REGRESS=0|1] [PEERS=0|1]
#   scripts/device/mla-prefill-bench.sh [--no-sanitizer]
# shellcheck disable=SC2086
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/mla-prefill-bench-out}
mkdir -p "$OUT"
SAN=1
for a in "$@"; do case $a in --no-sanitizer) SAN=0;; esac; done
KERNELS=${KERNELS:-dev}; DTYPES=${DTYPES:-bf16}; NS=${NS:-1024,2048,4096,8192,16384}
HQS=${HQS:-128,16}; REGRESS=${REGRESS:-1}; PEERS=${PEERS:-1}
declare -a SUMMARY
note() { SUMMARY+=("$(printf '%-34s %s' "$1" "$2")"); }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
B=${BUILD:-build-gpu-$KERNELS}
use_carried_libs absl lib
targets="cuda_mla_prefill_test cuda_mla_refusal_test mla_prefill_bench"
[ "$REGRESS" = 1 ] && targets="$targets cuda_backend_test cuda_score_mods_test"
t0=$(date +%s)
if cuda_build . "$B" "$OUT/build.log" $targets; then
  note build "ok ($(( $(date +%s) - t0 )) s)"
else
  note build "FAILED (see build.log)"; printf '%s\n' "${SUMMARY[@]}"; exit 1
fi
# ptxas' spill warnings of the MLA kernels (AttnFwdKernelDv; the Hopper
# ones: AttnFwdSm90Kernel instantiated with 192 and 128), if any.
grep -E "spill" "$OUT/build.log" | grep -cE "AttnFwdKernelDv|AttnFwdSm90KernelILi192ELi128E.*Li128EEEv" \
  >"$OUT/spills.txt"
note "MLA kernel spill warnings" "$(cat "$OUT/spills.txt")"
T=$B/tests/cuda

run_test() {  # run_test NAME LOG ARGS...
  local name=$1 log=$2; shift 2
  timeout 300 "$@" >"$OUT/$log" 2>&1; local rc=$?
  note "$name" "rc=$rc $(gtest_counts "$OUT/$log")"
  grep -E '^\[  FAILED  \]|Failure|Which is' "$OUT/$log" | head -10
}
run_test "mla prefill tests (plan)" mla-tests.log $T/cuda_mla_prefill_test
ATTNSERVE_CUDA_PORTABLE=1 run_test "mla prefill tests (portable)" mla-tests-portable.log \
  $T/cuda_mla_prefill_test
run_test "mla refusal tests" mla-refusal.log $T/cuda_mla_refusal_test
if [ "$REGRESS" = 1 ]; then
  ATTNSERVE_CUDA_PORTABLE=1 run_test "cuda_backend_test (portable)" backend-tests.log \
    $T/cuda_backend_test \
    --gtest_filter='-Sm90/*:Fp8/*'
  ATTNSERVE_CUDA_PORTABLE=1 run_test "cuda_score_mods_test (portable)" mods-tests.log \
    $T/cuda_score_mods_test
fi
if [ "$SAN" = 1 ] && command -v compute-sanitizer >/dev/null; then
  filt='Shapes/*_0:Shapes/*_8:Mods/*_1:Mods/*_2:Split/*_0:Split/*_2'
  for tool in memcheck racecheck synccheck; do
    timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 $T/cuda_mla_prefill_test \
      --gtest_filter="$filt" >"$OUT/sanitizer-$tool.log" 2>&1
    note "sanitizer $tool" "rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool.log" | tail -1)"
  done
  ATTNSERVE_CUDA_PORTABLE=1 timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 \
    $T/cuda_mla_prefill_test --gtest_filter="$filt" >"$OUT/sanitizer-memcheck-portable.log" 2>&1
  note "sanitizer memcheck (portable)" "rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer-memcheck-portable.log" | tail -1)"
fi

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
CSV=$OUT/mla-prefill.csv
{
  echo "# gpu: $gpu; driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"
  echo "# $(nvcc --version 2>/dev/null | tail -2 | head -1); torch $(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null)"
  echo "# tree $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo '+uncommitted'); $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "kind,dtype,dqk,dv,b,hq,hkv,sq,sk,causal,impl,kernel,ms,tflops"
} >"$CSV"
same=0
[ "$KERNELS" = all ] && same=1
: >"$OUT/bench.log"
for dt in $DTYPES; do
  timeout 400 $B/bench/cuda/mla_prefill_bench --dtype=$dt --ns=$NS --hqs=$HQS --same_dims=$same \
    --csv="$OUT/ours-$dt.csv" >>"$OUT/bench.log" 2>&1
  note "mla_prefill_bench $dt" "rc=$? $(grep -c FAILED "$OUT/bench.log") failed, $(grep -c skipped "$OUT/bench.log") skipped"
  grep -v '^kind' "$OUT/ours-$dt.csv" >>"$CSV" 2>/dev/null
  if [ "$PEERS" = 1 ]; then
    timeout 600 python3 bench/gpu/mla_sdpa_bench.py --dtype=$dt --ns=$NS --hqs=$HQS \
      --csv="$OUT/sdpa-$dt.csv" 2>"$OUT/sdpa-$dt.log"
    note "mla_sdpa_bench $dt" "rc=$? rows $(grep -vc '^kind' "$OUT/sdpa-$dt.csv"), skips $(grep -c '^skip' "$OUT/sdpa-$dt.log")"
    grep -v '^kind' "$OUT/sdpa-$dt.csv" >>"$CSV" 2>/dev/null
  fi
done

printf '%s\n' "${SUMMARY[@]}"
echo
grep -E '^validate' "$OUT/bench.log"
sort -u "$OUT"/sdpa-*.log 2>/dev/null | cut -c1-150 | head -8
echo
# One table: per shape, ours and the fastest SDPA row (its impl), ours / it.
python3 - "$CSV" <<'EOF'
import csv, sys
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if not l.startswith("#"))]
key = lambda r: (r["dtype"], int(r["hq"]), int(r["sq"]), int(r["causal"]))
shapes = sorted({key(r) for r in rows}, key=lambda k: (k[0], -k[1], k[2], k[3]))
print(f"{'dtype':5} {'hq':>4} {'b':>3} {'n':>6} {'c':>2} {'ours':>7} {'kernel':<18} "
      f"{'best sdpa':>9} {'impl':<22} {'ours/sdpa':>9} {'short/ours':>10}  (TFLOP/s)")
for k in shapes:
    mine = [r for r in rows if key(r) == k and r["impl"] == "ours"]
    peers = [r for r in rows if key(r) == k and r["impl"].startswith("sdpa")]
    best = max(peers, key=lambda r: float(r["tflops"])) if peers else None
    short = [r for r in rows if key(r) == k and r["impl"] == "ours_short_tile"]
    o = float(mine[0]["tflops"]) if mine else float("nan")
    p = float(best["tflops"]) if best else float("nan")
    s = float(short[0]["tflops"]) / o if short and mine else float("nan")
    b = (mine or peers)[0]["b"]
    print(f"{k[0]:5} {k[1]:>4} {b:>3} {k[2]:>6} {k[3]:>2} {o:7.1f} "
          f"{mine[0]['kernel'] if mine else '-':<18} {p:9.1f} "
          f"{best['impl'] if best else '-':<22} {o / p if best and mine else float('nan'):9.3f} "
          f"{s:10.3f}")
same = [r for r in rows if r["impl"] == "ours_same_dims"]
if same:
    print("\nequal dims (D 192, V padded), same useful FLOPs:")
    for r in same:
        print(f"  hq {r['hq']} n {r['sq']} causal {r['causal']}: {float(r['tflops']):.1f} ({r['kernel']})")
EOF
