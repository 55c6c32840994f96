#!/usr/bin/env bash
# On the GPU machine (device `run`, .device-carry/absl from
# scripts/device/pack-device-deps.sh): the paged K/V kernels' checks and benchmark in
# one go. Builds the CUDA tests and attn_bench (server off), runs
# cuda_paged_test and cuda_backend_test, compute-sanitizer memcheck on a
# paged subset, the K/V decode benchmark (ours contiguous, ours paged with
# 16- and 64-token pages, PyTorch SDPA CUDNN and FLASH) into
# $OUT/kv-<gpu>-<date>.csv, and ncu on the B=1 decode kernels. With BASE=DIR
# (an older tree) also builds its attn_bench and runs both on the quick grid
# (ours only) for an A/B of the contiguous path. A summary is printed last.
# BUILD names the build folder, CUDA_FLAGS adds nvcc flags (a variant),
# SDPA_CSV=FILE reuses SDPA rows from an earlier run instead of timing again.
# Usage: [KERNELS=dev|all] [TESTS="cuda_paged_test ..."] [BASE=DIR] [NCU=0] [BUILD=dir] [CUDA_FLAGS=..] [SDPA_CSV=file] scripts/device/gpu-kv.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/gpu-kv-out}
mkdir -p "$OUT"
KERNELS=${KERNELS:-dev}
declare -a SUMMARY
note() { SUMMARY+=("$(printf '%-28s %s' "$1" "$2")"); }
use_carried_libs absl
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
t0=$(date +%s)
B=${BUILD:-build-gpu}
if cuda_build . "$B" "$OUT/build.log" cuda_backend_test cuda_paged_test attn_bench; then
  note build "ok ($(( $(date +%s) - t0 )) s, kernels=$KERNELS, flags=${CUDA_FLAGS:-none})"
else
  note build "FAILED"; printf '%s\n' "${SUMMARY[@]}"; exit 1
fi

for t in ${TESTS:-cuda_paged_test cuda_backend_test}; do
  timeout 300 $B/tests/cuda/$t >"$OUT/$t.log" 2>&1; rc=$?
  note "$t" "rc=$rc $(gtest_counts "$OUT/$t.log")"
  grep -E '^\[  FAILED  \]|Failure|Expected|Which is|differs|error' "$OUT/$t.log" | head -20
done

# (Not the allocation-failure test: the sanitizer reports its intended
# cudaErrorMemoryAllocation as an error.)
FILTER='Paged/*h8x1_d128*:Paged/*cow*:Paged/*q0_1_3*:CudaPaged.PageId*'
timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 $B/tests/cuda/cuda_paged_test --gtest_filter="$FILTER" \
  >"$OUT/memcheck.log" 2>&1; rc=$?
note "memcheck (paged subset)" "rc=$rc tests_ok=$(grep -c '^\[       OK \]' "$OUT/memcheck.log") $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | head -1)"

if [ -n "${BASE:-}" ] && cuda_build "$BASE" build-base "$OUT/build-base.log" attn_bench; then
  for v in base new; do
    bin=$([ $v = base ] && echo build-base || echo $B)/bench/cuda/attn_bench
    $bin --grid=quick --dtypes=bf16 --impls=ours --csv="$OUT/ab-$v.csv" 2>>"$OUT/ab.log"
  done
  python3 - "$OUT/ab-base.csv" "$OUT/ab-new.csv" >"$OUT/ab.txt" <<'EOF'
import csv, sys
rows = [{(r["kind"], r["d"], r["b"], r["sk"], r["causal"]): r for r in csv.DictReader(open(f))} for f in sys.argv[1:]]
print("contiguous A/B (bf16, quick grid): kind d b sk causal | base ms | new ms | new/base speed")
for k, a in rows[0].items():
    b = rows[1].get(k)
    if b: print(" ".join(k), "|", a["ms"], "|", b["ms"], "|", f"{float(a['ms']) / float(b['ms']):.3f}")
EOF
  note "contiguous A/B" "$(awk -F'|' 'NR>1{s=$4+0; if(min==""||s<min)min=s; if(s>max)max=s} END{printf "new/base speed %s..%s", min, max}' "$OUT/ab.txt")"
fi

date_s=$(date +%Y-%m-%d)
slug=$(echo "$gpu" | tr 'A-Z' 'a-z' | sed -E 's/nvidia //; s/[^a-z0-9]+/-/g; s/-+$//')
csv="$OUT/kv-$slug-$date_s.csv"
$B/bench/cuda/attn_bench --grid=decode --dtypes=bf16 --impls=${IMPLS:-ours,portable,paged16,paged64,paged16_portable,kvread} \
  --csv="$OUT/decode-ours.csv" \
  --kv_csv="$OUT/kv-ours.csv" 2>"$OUT/attn_bench.log"
if [ -n "${SDPA_CSV:-}" ]; then
  cp "$SDPA_CSV" "$OUT/kv-sdpa.csv"
else
  python3 bench/gpu/sdpa_bench.py --grid=decode --dtypes=bf16 --csv="$OUT/decode-sdpa.csv" --kv_csv="$OUT/kv-sdpa.csv" \
    2>"$OUT/sdpa.log"
  cp "$OUT/kv-sdpa.csv" /tmp/kv-sdpa.csv
fi
{
  echo "# gpu: $gpu"
  echo "# clocks (sm, max sm, mem MHz): $(nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader | head -1)"
  echo "# driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1); nvcc: $(nvcc --version | tail -2 | head -1)"
  echo "# torch: $(python3 -c 'import torch; print(torch.__version__, "cudnn", torch.backends.cudnn.version())' 2>/dev/null)"
  echo "# commit: ${COMMIT:-unknown} (nvcc flags: ${CUDA_FLAGS:-none}); date: $date_s; decode grid Hq=32 Hkv=8 D=128 Sq=1 bf16; one layer per step"
  echo "# timing: CUDA events, L2 flushed (256 MB write) before each run, 5 warm-ups, 100 runs; tbps = K+V bytes / p50"
  echo "scenario,impl,sequences,context,layers,page_size,tokens_per_s,tbps,p50_ms,p99_ms"
  cat "$OUT/kv-ours.csv" "$OUT/kv-sdpa.csv"
} >"$csv"
python3 - "$csv" >"$OUT/kv-table.txt" <<'EOF'
import csv, sys
rows = list(csv.DictReader(l for l in open(sys.argv[1]) if not l.startswith("#")))
by = {}
for r in rows:
    by[(r["sequences"], r["context"], r["impl"], r["page_size"])] = float(r["tbps"])
# TB/s of K+V; "port", "p16port": the portable kernel (on sm90 the others
# are the planner's choice, the Hopper decode kernel).
print(f"{'B':>3} {'Sk':>6} {'contig':>7} {'port':>6} {'paged16':>8} {'p16port':>8} {'paged64':>8} {'cudnn':>6} {'flash':>6} | con/port p16/p16port p16/con p64/con con/cud p16/cud p64/cud con/max")
for b, sk in (("1", "8192"), ("16", "8192"), ("64", "4096"), ("8", "65536")):
    c = by.get((b, sk, "ours_contiguous", "")); p16 = by.get((b, sk, "ours_paged", "16"))
    cp = by.get((b, sk, "ours_portable_contiguous", "")); p16p = by.get((b, sk, "ours_portable_paged", "16"))
    p64 = by.get((b, sk, "ours_paged", "64")); cu = by.get((b, sk, "sdpa_cudnn", "")); fl = by.get((b, sk, "sdpa_flash", ""))
    f = lambda x: f"{x:.2f}" if x else "-"
    r = lambda a, d: f"{a / d:.3f}" if a and d else "-"
    best = max(cu or 0, fl or 0)
    print(f"{b:>3} {sk:>6} {f(c):>7} {f(cp):>6} {f(p16):>8} {f(p16p):>8} {f(p64):>8} {f(cu):>6} {f(fl):>6} | "
          f"{r(c, cp):>8} {r(p16, p16p):>11} {r(p16, c):>7} {r(p64, c):>7} {r(c, cu):>7} {r(p16, cu):>7} {r(p64, cu):>7} {r(c, best):>7}")
EOF
grep -E "SKIP|FAIL" "$OUT/attn_bench.log" | head -5

if [ "${NCU:-1}" = 1 ]; then
  for k in AttnFwdKernel PagedAttnFwdKernel; do
    timeout 120 ncu --clock-control none --kernel-name "regex:(^|:)$k(<|$)" --launch-skip 6 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
      --section LaunchStats $B/bench/cuda/attn_bench --grid=decode --dtypes=bf16 \
      --impls="$([ $k = AttnFwdKernel ] && echo ours || echo paged16)" --csv=/dev/null >"$OUT/ncu-$k.txt" 2>&1
    note "ncu $k B=1" "$(grep -E 'Duration|DRAM Throughput|Achieved Occupancy' "$OUT/ncu-$k.txt" | tr -s ' ' | head -3 | tr '\n' ';')"
  done
fi
echo "==== gpu-kv summary ($gpu)"
printf '%s\n' "${SUMMARY[@]}"
cat "$OUT/ab.txt" 2>/dev/null | tail -20
cat "$OUT/kv-table.txt"
# The device tool returns at most 8 files: everything else travels in one tarball.
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude='kv-h*.csv' --exclude='kv-table.txt' --exclude=console.log * 2>/dev/null &&
  find . -maxdepth 1 -type f ! -name logs.tgz ! -name 'kv-h*.csv' ! -name kv-table.txt ! -name console.log -delete)
