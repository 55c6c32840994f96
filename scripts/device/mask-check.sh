#!/usr/bin/env bash
# On the GPU machine (device `run`, carrying .device-carry/absl): issue 25's GPU
# check in one call on the current tree. Builds the backend's CUDA mask tests and
# mask_bench (server off; KERNELS=all by default: the D 64 Hopper kernels are in
# no smaller set), then, with the GPU to itself, the benchmarks: D 64
# block-sparse (random, stripes; N 8k-32k; s 1-0.05) against FlexAttention
# (compiled, the same block masks) and the bias grid against SDPA with an
# attn_mask (its fastest backend); then, all at once, every CUDA
# mask/bias/block-sparse/ALiBi/sinks test (paged ALiBi/sinks: the kernel that
# attend_pages' compacted block tables run on) and compute-sanitizer memcheck +
# racecheck on a few cases that cover the whole-row bias kernel, the item-order
# pre-kernel, the varlen offset scan (2,100 sequences) and paged ALiBi/sinks.
# $OUT (or ./mask-check-out) gets 8 files: build.log, tests.log, sanitizer.log,
# bench.log, ours.csv, peers.csv, masks-<gpu>-<date>.csv (merged, with the
# peer ratios) and summary.txt, which is also printed last.
# Usage: [KERNELS=all|dev (dev: D 128 only, no D 64 rows)] [ATTNSERVE_COMMIT=sha]
#   scripts/device/mask-check.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/mask-check-out}
mkdir -p "$OUT"
export KERNELS=${KERNELS:-all}
B=build-gpu
[ "$KERNELS" = dev ] && B=build-gpu-dev
T=$B/tests/cuda
L=$(mktemp -d)  # per-job logs, merged into $OUT at the end
use_carried_libs absl
t0=$(date +%s)
# Seconds left of a 9-minute budget (the device call's limit is 10), at most $1.
left() {
  local l=$((540 - ($(date +%s) - t0)))
  [ "$l" -lt 20 ] && l=20
  [ "$l" -gt "$1" ] && l=$1
  echo "$l"
}
SUMMARY=()
note() { SUMMARY+=("$(printf '%-44s %s' "$1" "$2")"); }

TESTS="sm90_block_sparse_test sm90_bias_test cuda_score_mods_test cuda_paged_test cuda_paged_fp8_test
  cuda_mla_prefill_test cuda_paged_mla_test"
# shellcheck disable=SC2086  # the target list
if ! cuda_build . "$B" "$OUT/build.log" $TESTS mask_bench; then
  echo "build FAILED (see build.log)"
  exit 1
fi
note build "ok, KERNELS=$KERNELS ($(($(date +%s) - t0)) s)"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
slug=$(echo "$gpu" | tr '[:upper:]' '[:lower:]' | sed -E 's/nvidia //; s/[^a-z0-9]+/-/g; s/-+$//')
commit=${ATTNSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

# 1. Benchmarks, alone on the GPU. D 64 sparse rows write their block masks
# for the FlexAttention peer; the bias grid is D 128 (mask_bench's).
masks=$(mktemp -d)
tb=$(date +%s)
timeout "$(left 150)" $B/bench/cuda/mask_bench --grid=sparse --dims=64 --ns=8192,16384,32768 \
  --csv="$L/sparse.csv" --mask_dir="$masks" 2>"$L/mask_bench-sparse.log"
rc=$?
note "mask_bench D 64 sparse" "rc=$rc rows=$(($(wc -l <"$L/sparse.csv") - 1))"
timeout "$(left 90)" $B/bench/cuda/mask_bench --grid=bias --csv="$L/bias.csv" \
  2>"$L/mask_bench-bias.log"
rc=$?
note "mask_bench bias" "rc=$rc rows=$(($(wc -l <"$L/bias.csv") - 1))"
{ cat "$L/sparse.csv"; tail -n +2 "$L/bias.csv"; } >"$OUT/ours.csv"
timeout "$(left 300)" python3 bench/gpu/mask_peers.py --mask_dir "$masks" --csv "$OUT/peers.csv" \
  2>"$L/peers.log"
rc=$?
note "mask_peers (flex, sdpa)" "rc=$rc rows=$(($(wc -l <"$OUT/peers.csv") - 1)) ($(($(date +%s) - tb)) s bench)"
rm -rf "$masks"
{
  echo "# gpu: $gpu"
  echo "# driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1); nvcc: $(nvcc --version | tail -2 | head -1)"
  echo "# torch: $(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null)"
  echo "# commit: $commit (working tree as carried); date: $(date +%Y-%m-%d); KERNELS=$KERNELS"
  echo "# mask_bench --grid=sparse --dims=64 and --grid=bias; peers: bench/gpu/mask_peers.py; CUDA events, L2 flushed, median of 15"
  echo "# bound = ms / (kept x plain ms) for sparse rows (target <= 1.15), ms / plain ms otherwise"
} >"$L/header.txt"
merged="$OUT/masks-$slug-$(date +%Y-%m-%d).csv"
python3 bench/gpu/mask_table.py "$OUT/ours.csv" "$OUT/peers.csv" --header "$L/header.txt" \
  --out "$merged" >"$L/mask_table.txt" 2>&1

# 2. Tests and sanitizers, all at once (each job: a binary, a filter).
job() {  # NAME TIMEOUT CMD...
  local name=$1 to=$2
  shift 2
  (
    timeout "$to" "$@" >"$L/job-$name.log" 2>&1
    echo $? >"$L/job-$name.rc"
  ) &
}
tt=$(date +%s)
# The paged kernels' modifiers (FP8 decode: 1 sinks, 5 ALiBi + softcap; MLA shares the mods code).
job paged "$(left 300)" $T/cuda_paged_test
job paged_fp8 "$(left 300)" $T/cuda_paged_fp8_test --gtest_filter='Fp8Decode/*/1:Fp8Decode/*/5'
job mla_prefill "$(left 300)" $T/cuda_mla_prefill_test --gtest_filter='Mods/*:Split/*sinks*'
job paged_mla "$(left 300)" $T/cuda_paged_mla_test --gtest_filter='*alibi*:*sinks*'
for t in sm90_block_sparse_test sm90_bias_test cuda_score_mods_test; do
  job "${t%_test}" "$(left 300)" $T/$t
done
# Sanitizer cases: whole-row bias (Sk 328: a bias alone; k520: beside ALiBi,
# softcap and a block mask) and one fragment-word bias; the item-order
# pre-kernel (block-masked varlen, empty block rows with sinks, banded
# stripes, D 64); the varlen offset scan (2,100 sequences: decode tile, then
# one long run on the Hopper kernels, bias+mask and block mask); paged ALiBi
# + sinks (split decode, prefill tile + combine, an empty sequence).
declare -A SAN=(
  [sm90_bias_test]='Sm90/*bf16_b2_q300_k328_h4x2_d128*biasbf16_BH*:Sm90/*bf16_b2_q400_k520_h4x2_d128*:Sm90/*bf16_b2_q300_k300_h4x2_d128_biasfp16_11*'
  [sm90_block_sparse_test]='Sm90/*/bf16_d128_varlen_random50:Sm90/*/fp16_d128_causal_varlen_alibi_sinks_random25:Sm90/*/bf16_d128_empty_rows_sinks:Sm90/*/bf16_d64_window300_softcap_alibi_stripes50'
  [cuda_score_mods_test]='Many/*many_sequences_0:Many/*many_sequences_1:Many/*many_sequences_2'
  [cuda_paged_test]='Paged/*bf16_varlen_q1_k8192_h32x8_d128_alibi_sinks_*:Paged/*bf16_varlen_q64_k8192_h8x8_d128_alibi_sinks_*:Paged/*bf16_varlen_q3_5_k0_300_*'
)
for t in "${!SAN[@]}"; do
  for tool in memcheck racecheck; do
    job "san-$tool-${t%_test}" "$(left 300)" compute-sanitizer --tool $tool --error-exitcode 9 \
      "$T/$t" --gtest_filter="${SAN[$t]}"
  done
done
wait
note "tests + sanitizers" "$(($(date +%s) - tt)) s"
for f in "$L"/job-*.log; do
  n=$(basename "$f" .log)
  n=${n#job-}
  rc=$(cat "$L/job-$n.rc" 2>/dev/null || echo "?")
  case $n in
    san-*)
      note "$n" "rc=$rc ok=$(grep -cE '^\[       OK \]' "$f") $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$f" | head -1)"
      { echo "==== $n rc=$rc"; cat "$f"; } >>"$OUT/sanitizer.log" ;;
    *)
      note "$n" "rc=$rc $(gtest_counts "$f")"
      { echo "==== $n rc=$rc"; cat "$f"; } >>"$OUT/tests.log" ;;
  esac
done
# 3. Why a bias costs what it does: ncu on the N 8k shared-bias case (B 2, H 16, D 128), the
# plain kernel then the whole-row bias kernel, both timed in mask_bench's 7th bias case. Each
# case launches AttnFwdSm90Kernel 37 times (validation 1, plain 18, bias 18): plain 223-240,
# bias 241-258 (0-based); skips of 230 and 250 land inside them. Only when time is left.
: >"$L/ncu.txt"
if command -v ncu >/dev/null && [ "$(left 600)" -ge 90 ]; then
  for skip in 230 250; do
    echo "==== ncu launch $skip of AttnFwdSm90Kernel (mask_bench --grid=bias)" >>"$L/ncu.txt"
    timeout "$(left 60)" ncu --clock-control none -k regex:AttnFwdSm90Kernel --launch-skip $skip \
      --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section InstructionStats --section WarpStateStats --section MemoryWorkloadAnalysis \
      $B/bench/cuda/mask_bench --grid=bias --csv=/dev/null >>"$L/ncu.txt" 2>&1
    rc=$?
    note "ncu launch $skip" "rc=$rc $(grep -E '^ +(Duration|Executed Instructions|Issue Slots Busy|Warp Cycles Per Issued Instruction) ' "$L/ncu.txt" |
      tail -4 | awk '{v = $NF; u = $(NF - 1); NF -= 2; $1 = $1; printf "%s %s %s; ", $0, v, u}')"
  done
fi
for f in mask_bench-sparse.log mask_bench-bias.log peers.log mask_table.txt ncu.txt; do
  echo "==== $f"
  cat "$L/$f"
done >"$OUT/bench.log"

# 4. The table: checks, then one line per D 64 sparse pattern and N (bound per s;
# x flex = flex ms / ours, > 1: we are faster) and one per bias case.
{
  echo "==== mask-check on $gpu, $commit, $(($(date +%s) - t0)) s"
  printf '%s\n' "${SUMMARY[@]}"
  grep -hE '^\[  FAILED  \] [A-Z]' "$L"/job-*.log 2>/dev/null | sort -u | head -10
  [ -s "$merged" ] && awk -F, '
    /^#/ || $1 == "grid" {next}
    $1 == "sparse" {k = $2 " n=" $8; if (!(k in seen)) {seen[k] = 1; keys[++nk] = k}
      b[k] = b[k] sprintf(" %s:%s", $9, $16); x[k] = x[k] sprintf(" %s", $21 == "" ? "-" : $21)}
    $1 == "bias" {bias[++nb] = sprintf("bias %-11s n=%-5s ms=%-7s plain=%-7s x_plain=%-6s TB/s=%-5s vs %s: %s ms, x=%s",
      $3, $8, $13, $14, $15, $17, $19, $20, $21)}
    END {print "block-sparse D 64, 32 heads: s:bound (target <= 1.15) | x flex at s = 1 .5 .25 .1 .05 (>= 1.0: we are faster)";
      for (i = 1; i <= nk; i++) printf "%-20s%s |%s\n", keys[i], b[keys[i]], x[keys[i]];
      print "bias, D 128: x_plain = ms / plain ms (target <= 1.25: >= 0.8x plain speed); x = SDPA ms / ours (target >= 1.0)";
      for (i = 1; i <= nb; i++) print bias[i]}' "$merged"
} >"$OUT/summary.txt"
rm -rf "$L"
cat "$OUT/summary.txt"
