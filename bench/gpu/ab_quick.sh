#!/usr/bin/env bash
# Tuning round on the GPU machine (one `run`): build + CUDA tests (no
# sanitizers, no e2e) via scripts/gpu-check.sh, then the reduced (quick) grid,
# bf16: ours, SDPA FLASH/CUDNN and, for decode, the kvread floor (a plain read
# of the K/V bytes), with a ratio table last. For an A/B of a tile candidate,
# build the candidate behind a temporary switch and set ALT_ENV (e.g.
# ALT_ENV=MY_SWITCH=1): tests and the grid then also run with it ("alt").
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/ab-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.device-carry/absl/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
OUT="$OUT/check" scripts/gpu-check.sh --no-sanitizer --no-e2e 2>&1 | tail -8
B=build-gpu/bench/cuda/attn_bench
$B --grid=quick --dtypes=bf16 --impls=ours,kvread --csv="$OUT/ours.csv" 2>"$OUT/ours.log"
if [ -n "${ALT_ENV:-}" ]; then
  env "$ALT_ENV" build-gpu/tests/cuda/cuda_backend_test >"$OUT/tests-alt.log" 2>&1
  echo "alt tests: rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests-alt.log" | tr '\n' ' ')"
  env "$ALT_ENV" $B --grid=quick --dtypes=bf16 --impls=ours --csv="$OUT/alt_all.csv" 2>"$OUT/alt.log"
fi
python3 bench/gpu/sdpa_bench.py --grid=quick --dtypes=bf16 --csv="$OUT/sdpa.csv" 2>"$OUT/sdpa.log"
python3 - "$OUT" <<'PY'
import csv, sys
out = sys.argv[1]
rows = {}
key = lambda r: (r["kind"], r["d"], r["b"], r["sq"], r["sk"], r["causal"])
for name, f in (("ours", "ours.csv"), ("alt", "alt_all.csv"), ("sdpa", "sdpa.csv")):
    try:
        for r in csv.DictReader(open(f"{out}/{f}")):
            impl = r["impl"] if name == "sdpa" or r["impl"] == "kvread" else name
            rows.setdefault(key(r), {})[impl] = r
    except FileNotFoundError:
        print("missing", f)
print(f"{'config':28s} {'ours':>7s} {'alt':>7s} {'flash':>7s} {'cudnn':>7s} {'o/fl':>5s} {'a/fl':>5s} {'o/cu':>5s} {'floor':>6s}")
for k, d in rows.items():
    if "ours" not in d:
        continue
    m = "tbps" if k[0] == "decode" else "tflops"
    g = lambda i: float(d[i][m]) if i in d else float("nan")
    o, a, fl, cu, fr = g("ours"), g("alt"), g("sdpa_flash"), g("sdpa_cudnn"), g("kvread")
    name = f"{k[0][:3]} d{k[1]} b{k[2]} {k[3]}x{k[4]}{' c' if k[5] == '1' else ''}"
    print(f"{name:28s} {o:7.2f} {a:7.2f} {fl:7.2f} {cu:7.2f} {o/fl:5.2f} {a/fl:5.2f} {o/cu:5.2f} {fr:6.2f}")
PY
