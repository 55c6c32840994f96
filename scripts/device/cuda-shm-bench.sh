#!/usr/bin/env bash
# On the GPU machine (device `run`; attnserve and attnctl built here with CUDA
# and carried: scripts/device/pack-device-deps.sh --server BUILD_DIR, as for
# scripts/device/gpu-v2.sh): KServe v2 CUDA shared memory against its bound.
# The large request of gpu-v2.sh (B=4, N=4096, H=16, D=128, FP16: q, k, v and
# o 64 MiB each, 256 MiB in all) at concurrency 1, unary:
#   v2-bytes      tensors in the message (the socket's cost, for scale)
#   v2-shm-system a POSIX region (host memory: staged to the GPU and back)
#   v2-shm-cuda   a CUDA region on the server's device: the kernel reads q, k
#                 and v and writes o where they lie (no copies)
#   v2-shm-cuda-peer (two GPUs) the region on device 0, the server on device
#                 1: one peer copy in per input and one out
# plus one `attnctl forward --verify` through the CUDA region (its O checked
# against the float64 reference), and, when carried as
# .device-carry/bin/cuda_shm_test (built from tests/cuda, with the libraries
# it loads in .device-carry/lib), the GPU test of CUDA regions.
# The bound of a row is the server's own compute time plus the copies it still
# makes (its host_to_device and device_to_host means); the target is
# p50 <= 1.5 x bound for the CUDA rows. Rows go to $OUT/cuda-shm-<gpu>-<date>.csv
# (attnctl load's columns plus bound_ms and p50_over_bound); a table is printed.
# Usage: scripts/device/cuda-shm-bench.sh [SECONDS per configuration, default 8]
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/cuda-shm-bench-out}
mkdir -p "$OUT"
seconds=${1:-8}
bin=${BIN:-.device-carry/bin}
if [ ! -x "$bin/attnserve" ] && [ -f .device-carry/server.tgz ]; then
  tar -C .device-carry -xzf .device-carry/server.tgz || exit 2
fi
use_carried_libs lib
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
[ -n "$gpu" ] || { echo "no GPU (nvidia-smi found none)"; exit 1; }
slug=$(echo "$gpu" | tr 'A-Z' 'a-z' | sed -E 's/nvidia //; s/[^a-z0-9]+/-/g; s/-+$//')
csv=$OUT/cuda-shm-$slug-$(date +%Y-%m-%d).csv
rows=$OUT/rows.csv
rm -f "$rows"
large=(--batch=4 --seqlen_q=4096 --heads_q=16 --heads_kv=16 --head_dim=128 --dtype=fp16)

pid=""
trap '[ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null; wait' EXIT
serve() {  # serve PORT DEVICES LOG: a CUDA server on those devices; sets pid
  start_server "$3" 60 "$bin/attnctl" --target="127.0.0.1:$1" -- \
    "$bin/attnserve" --backend=cuda --devices="$2" --host=127.0.0.1 --port="$1" \
    --log_level=warn --metrics_port=0 --http_port=0 --allow_client_shm || return 1
  pid=$SERVER_PID
}
stop() { kill -TERM "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; pid=""; }
load() {  # load PORT LABEL FLAGS...: one attnctl load step, its row appended to $rows
  local port=$1 label=$2
  shift 2
  echo "== $label" >&2
  timeout $((seconds * 3 + 60)) "$bin/attnctl" --target="127.0.0.1:$port" --timeout=120s load \
    --warmup=2s --duration="${seconds}s" --concurrency=1 --csv="$rows" --label="$label" \
    "${large[@]}" "$@" >"$OUT/$label.txt" 2>&1 ||
    { echo "$label failed:"; tail -5 "$OUT/$label.txt"; }
}

port=50091
serve $port 0 "$OUT/attnserve.log" || exit 1
echo "== verify through the CUDA region" >&2
# A smaller shape than the timed one: the float64 reference of the large
# case (~275 GFLOP on the client's CPU) outlasts any sensible timeout.
timeout 120 "$bin/attnctl" --target="127.0.0.1:$port" --timeout=120s forward --protocol=v2 \
  --shm=cuda --verify --seed=7 --batch=2 --seqlen_q=1024 --heads_q=16 --heads_kv=16 \
  --head_dim=128 --dtype=fp16 >"$OUT/verify.txt" 2>&1
echo "verify (v2, --shm=cuda, 2 x 1024): rc=$? $(grep -E 'PASS|FAIL' "$OUT/verify.txt" | head -1)"
load $port v2-bytes --protocol=v2
load $port v2-shm-system --protocol=v2 --shm=system
load $port v2-shm-cuda --protocol=v2 --shm=cuda
load $port native-bytes --protocol=native
stop
if [ "$gpus" -ge 2 ]; then
  # attnctl's CUDA region is on device 0: a server on device 1 copies across.
  port=50092
  if serve $port 1 "$OUT/attnserve-peer.log"; then
    load $port v2-shm-cuda-peer --protocol=v2 --shm=cuda
    stop
  fi
else
  echo "one GPU: no peer row (needs nvidia-h100-x2 or nvidia-h200-x2)"
fi

test_bin=$bin/cuda_shm_test
if [ -x "$test_bin" ]; then
  echo "== cuda_shm_test" >&2
  ATTNSERVE_BINARY=$PWD/$bin/attnserve timeout 300 "$test_bin" >"$OUT/cuda_shm_test.log" 2>&1
  echo "cuda_shm_test: rc=$? $(gtest_counts "$OUT/cuda_shm_test.log")"
  grep -E '^\[  FAILED  \]' "$OUT/cuda_shm_test.log" | head -10
else
  echo "no $test_bin: the GPU test not run (carry build/tests/cuda/cuda_shm_test there to run it)"
fi

[ -f "$rows" ] || { echo "no rows"; exit 1; }
{
  echo "# gpu: $gpu x$gpus; $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"
  echo "# commit: ${COMMIT:-unknown}; date: $(date +%Y-%m-%d); ${seconds} s per configuration after 2 s of warm-up; concurrency 1; server and client on one host"
  echo "# bound_ms = compute_ms + host_to_device_ms + device_to_host_ms (the server's means: the kernel and the copies it still makes)"
  python3 - "$rows" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
head = list(rows[0].keys()) + ["bound_ms", "p50_over_bound"]
w = csv.DictWriter(sys.stdout, fieldnames=head, lineterminator="\n")
w.writeheader()
for r in rows:
    bound = sum(float(r[k] or 0) for k in ("compute_ms", "host_to_device_ms", "device_to_host_ms"))
    r["bound_ms"] = f"{bound:.3f}"
    r["p50_over_bound"] = f"{float(r['p50_ms']) / bound:.2f}" if bound > 0 else ""
    w.writerow(r)
PY
} >"$csv"

python3 - "$csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(l for l in open(sys.argv[1]) if not l.startswith("#")))
print(f"{'configuration':<18} {'p50 ms':>8} {'p99 ms':>8} {'kernel':>8} {'copies':>8} {'bound':>8} {'p50/bound':>10}  target")
for r in rows:
    copies = float(r["host_to_device_ms"] or 0) + float(r["device_to_host_ms"] or 0)
    ratio = r["p50_over_bound"]
    target = ""
    if r["label"].startswith("v2-shm-cuda") and ratio:
        target = "met (<= 1.5)" if float(ratio) <= 1.5 else "MISSED (> 1.5)"
    print(f"{r['label']:<18} {float(r['p50_ms']):>8.3f} {float(r['p99_ms']):>8.3f} "
          f"{float(r['compute_ms'] or 0):>8.3f} {copies:>8.3f} {float(r['bound_ms']):>8.3f} {ratio:>10}  {target}")
PY
echo "rows: $csv"
