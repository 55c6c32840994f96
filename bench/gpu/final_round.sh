#!/usr/bin/env bash
# One `run` on the GPU machine: the full scripts/gpu-check.sh (build, CUDA
# tests, sanitizers, end-to-end against attnserve --backend=cuda), a decode
# split-count sweep (attn_bench --decode_splits), then scripts/gpu-bench.sh all
# in the time left under the 10-minute command limit.
set -uo pipefail
cd "$(dirname "$0")/../.."
FINAL=${OUT:-$PWD/final-out}
# Work in a scratch folder: the device tool returns only a few files from
# $OUT, so logs go back as one tarball plus the merged CSV and the summaries.
OUT=$(mktemp -d)
trap 'cp "$OUT"/check.txt "$OUT"/bench.txt "$OUT"/bench/*-20*.csv "$FINAL"/ 2>/dev/null; tar -czf "$FINAL/logs.tar.gz" -C "$OUT" .' EXIT
mkdir -p "$FINAL"
t0=$(date +%s)
OUT="$OUT/check" scripts/gpu-check.sh >"$OUT/check.txt" 2>&1
sed -n '/==== gpu-check summary/,$p' "$OUT/check.txt"
export LD_LIBRARY_PATH=$PWD/.device-carry/absl/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=build-gpu/bench/cuda/attn_bench
for s in 0 8 16 24 32 43 64 96; do
  timeout 60 $B --grid=decode --dtypes=bf16 --impls=ours --decode_splits=$s --csv="$OUT/split$s.csv" 2>/dev/null
done
python3 - "$OUT" <<'PY'
import csv, glob, re, sys
t = {}
for f in glob.glob(f"{sys.argv[1]}/split*.csv"):
    s = int(re.search(r"split(\d+)", f).group(1))
    for r in csv.DictReader(open(f)):
        t.setdefault((r["b"], r["sk"]), {})[s] = float(r["tbps"])
print("decode TB/s by split count (0 = planner):")
for k, v in sorted(t.items(), key=lambda kv: int(kv[0][0])):
    print(f"  B={k[0]:>3} Sk={k[1]:>6}: " + " ".join(f"{s}:{v[s]:.2f}" for s in sorted(v)))
PY
left=$((575 - ($(date +%s) - t0)))
echo "full bench: ${left}s left"
OUT="$OUT/bench" timeout "$left" scripts/gpu-bench.sh all >"$OUT/bench.txt" 2>&1
echo "gpu-bench rc=$? ($(( $(date +%s) - t0 )) s total)"
grep -E "^(pre|dec|config)" "$OUT/bench.txt" | cut -c1-84
