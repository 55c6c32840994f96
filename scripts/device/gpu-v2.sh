#!/usr/bin/env bash
# On the GPU machine (device `run`; the server and attnctl built with CUDA,
# scripts/device/pack-device-deps.sh --server BUILD_DIR, optionally bundled): issue
# 14's KServe-v2 benchmark, every side in one run against one server:
#   native vs v2 gRPC (tensors in the message), small (B=1, N=256, H=16,
#   D=128) and large (B=4, N=4096) requests, concurrency 1 and 16;
#   large requests with system shared memory and with CUDA shared memory
#   (v2), beside the same requests with bytes in the message;
#   perf_analyzer (the tritonclient 2.50.0 binary, when carried under
#   .device-carry/pa/: perf_analyzer, libb64.so.0d, libcudart.so.12) on
#   attention_dense with the same shapes, beside attnctl's v2 rows.
# Rows go to $OUT/v2-<gpu>-<date>.csv (attnctl load's columns; perf_analyzer
# rows are labelled pa-*); a table of req/s, p50 and the ratios the issue
# sets targets for is printed last.
# Usage: scripts/device/gpu-v2.sh [SECONDS per configuration, default 8]
#   BACKEND=cpu runs the same against a CPU server (a dry run of the script;
#   LARGE_N=512 keeps its "large" requests small enough for a CPU).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/gpu-v2-out}
mkdir -p "$OUT"
seconds=${1:-8}
backend=${BACKEND:-cuda}
bin=${BIN:-.device-carry/bin}
if [ ! -x "$bin/attnserve" ] && [ -f .device-carry/server.tgz ]; then
  tar -C .device-carry -xzf .device-carry/server.tgz || exit 2
fi
use_carried_libs lib
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
gpu=${gpu:-cpu}
slug=$(echo "$gpu" | tr 'A-Z' 'a-z' | sed -E 's/nvidia //; s/[^a-z0-9]+/-/g; s/-+$//')
csv=$OUT/v2-$slug-$(date +%Y-%m-%d).csv
rows=$OUT/rows.csv
rm -f "$rows"

port=50081
pid=""
trap '[ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null; wait' EXIT
start_server "$OUT/attnserve.log" 60 "$bin/attnctl" --target="127.0.0.1:$port" -- \
  "$bin/attnserve" --backend="$backend" --host=127.0.0.1 --port="$port" --log_level=warn \
  --metrics_port=0 --http_port=0 --allow_client_shm || exit 1
pid=$SERVER_PID
ctl=("$bin/attnctl" --target="127.0.0.1:$port" --timeout=120s)
small=(--batch=1 --seqlen_q=256 --heads_q=16 --heads_kv=16 --head_dim=128 --dtype=fp16)
large_n=${LARGE_N:-4096}
large=(--batch=4 --seqlen_q="$large_n" --heads_q=16 --heads_kv=16 --head_dim=128 --dtype=fp16)

load() {  # load LABEL FLAGS...: one attnctl load configuration, rows appended to $rows
  local label=$1; shift
  echo "== $label" >&2
  timeout $((seconds * 3 + 60)) "${ctl[@]}" load --warmup=2s --duration="${seconds}s" \
    --csv="$rows" --label="$label" "$@" >"$OUT/$label.txt" 2>&1 ||
    { echo "$label failed:"; tail -5 "$OUT/$label.txt"; }
}
for size in small large; do
  if [ $size = small ]; then shape=("${small[@]}"); else shape=("${large[@]}"); fi
  for proto in native v2; do
    load "$proto-$size" "${shape[@]}" --protocol="$proto" --concurrency=1,16 --channels=4
  done
done
load v2-large-shm-system "${large[@]}" --protocol=v2 --shm=system --concurrency=1,16 --channels=4
if [ "$backend" = cuda ]; then
  load v2-large-shm-cuda "${large[@]}" --protocol=v2 --shm=cuda --concurrency=1,16 --channels=4
fi

# perf_analyzer beside attnctl: zeros as data (attention of zeros costs the
# same), the same shapes, concurrency 1 and 16.
pa=.device-carry/pa/perf_analyzer
if [ -x "$pa" ]; then
  for size in small large; do
    if [ $size = small ]; then s=1,256,16,128; else s=4,$large_n,16,128; fi
    for c in 1 16; do
      echo "== pa-$size-c$c" >&2
      LD_LIBRARY_PATH=$PWD/.device-carry/pa${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} timeout 180 "$pa" \
        -m attention_dense -u "127.0.0.1:$port" -i grpc --input-data zero \
        --shape "q:$s" --shape "k:$s" --shape "v:$s" --concurrency-range "$c" \
        --measurement-interval $((seconds * 1000)) --percentile=50 --stability-percentage=50 --max-trials=6 >"$OUT/pa-$size-c$c.txt" 2>&1 ||
        { echo "pa-$size-c$c failed:"; tail -5 "$OUT/pa-$size-c$c.txt"; }
    done
  done
else
  echo "no $pa: perf_analyzer rows skipped"
fi
kill -TERM "$pid"; wait "$pid"; pid=""

{
  echo "# gpu: $gpu; backend: $backend; $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo "# commit: ${COMMIT:-unknown}; date: $(date +%Y-%m-%d); ${seconds} s per configuration after 2 s of warm-up; server and client on one host"
  echo "# pa-* rows: perf_analyzer (tritonclient 2.50.0) on attention_dense, zeros, FP16; req/s and p50 from its own report"
  # perf_analyzer's summary: "Concurrency: C, throughput: X infer/sec, latency Y usec".
  LARGE_N=$large_n python3 - "$rows" "$OUT" <<'PY'
import csv, glob, os, re, sys
rows = list(csv.DictReader(open(sys.argv[1])))
head = list(rows[0].keys()) if rows else []
w = csv.DictWriter(sys.stdout, fieldnames=head, lineterminator="\n")
w.writeheader()
w.writerows(rows)
for f in sorted(glob.glob(os.path.join(sys.argv[2], "pa-*.txt"))):
    m = re.search(r"Concurrency: (\d+), throughput: ([\d.]+) infer/sec, latency (\d+) usec", open(f).read())
    if not m:
        continue
    label = os.path.basename(f)[:-4]
    big = "large" in label
    w.writerow({**{k: "" for k in head}, "label": label, "mode": "perf_analyzer", "concurrency": m[1],
                "req_per_s": m[2], "p50_ms": int(m[3]) / 1000, "protocol": "v2", "shm": "none",
                "dtype": "FP16", "batch": 4 if big else 1, "seqlen_q": int(os.environ["LARGE_N"]) if big else 256,
                "heads_q": 16, "heads_kv": 16, "head_dim": 128})
PY
} >"$csv"

python3 - "$csv" <<'EOF'
import csv, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if not l.startswith("#"))]
head, data = rows[0], rows[1:]
col = {n: i for i, n in enumerate(head)}
by = {}
for r in data:
    label = r[col["label"]].removesuffix("-c" + r[col["concurrency"]])
    by[(label, r[col["concurrency"]])] = (float(r[col["req_per_s"]]), float(r[col["p50_ms"]]))
print(f"{'configuration':<24} {'c':>3} {'req/s':>9} {'p50 ms':>8}")
for (label, c), (rps, p50) in sorted(by.items()):
    print(f"{label:<24} {c:>3} {rps:>9.1f} {p50:>8.3f}")
def ratio(a, b, c):
    x, y = by.get((a, c)), by.get((b, c))
    return f"{x[0] / y[0]:.3f}" if x and y and y[0] else "-"
for c in ("1", "16"):
    print(f"c={c}: v2/native small {ratio('v2-small', 'native-small', c)}, large {ratio('v2-large', 'native-large', c)}; "
          f"shm system/bytes large {ratio('v2-large-shm-system', 'v2-large', c)}; "
          f"shm cuda/bytes large {ratio('v2-large-shm-cuda', 'v2-large', c)}; "
          f"perf_analyzer/attnctl v2 small {ratio('pa-small', 'v2-small', c)}, large {ratio('pa-large', 'v2-large', c)}")
EOF
