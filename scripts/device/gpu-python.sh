#!/usr/bin/env bash
# On the GPU machine in one run: the Python client and the
# transformers integration against the carried CUDA server.
#  1. installs the carried wheels (.device-carry/wheels: attnserve, protobuf,
#     grpcio-health-checking; scripts/device/pack-python-carry.sh) into .device-carry/pylib;
#  2. starts .device-carry/bin/attnserve --backend=cuda on GPU 0 (libraries
#     from .device-carry/lib; or both unpacked from .device-carry/server.tgz);
#  3. the identical-tokens test: python/tests/test_hf.py's FP32 tests (64 greedy
#     tokens, mixed-length batch, "attnserve" in both modes == "sdpa", TF32 off)
#     with the model on the GPU and the CUDA server as ATTNSERVE_TARGET;
#  4. the BF16 report: python -m attnserve.hf_compare --dtype bfloat16 (first
#     differing step and logit margins, both modes, and eager vs sdpa);
#  5. bench/gpu/python_bench.py: Python client vs attnctl load (small B=1 N=256
#     H=16 D=128 and large B=4 N=4096, concurrency 1 and 16; unary on each
#     transport: attnserve._native, gRPC C++, and grpcio), and generate()
#     with K/V on the server vs local SDPA (small Llama and a 1B-sized Llama,
#     BF16, batch 1 and 32, where the time goes).
# Everything lands in $OUT: python-<gpu>-<date>.csv (environment, test result
# and the BF16 report as `#` lines, then the benchmark rows), attnserve.log,
# test-hf.txt, hf-bf16.txt, bench.txt. A short table is printed last.
#
# --cpu: the same steps on a machine without a GPU, to try the script before
# the GPU run: the server with --backend=cpu, the model on the CPU (one torch
# thread), small sizes (--quick bench, small scenario and model only).
# Binaries: .device-carry/bin (scripts/device/pack-device-deps.sh --server BUILD; a
# CPU build for --cpu). Environment: PYTHON (default python3) runs the Python
# parts; CARRY names the carried folder when it is not this tree's
# .device-carry (e.g. the script runs from a copy of a branch under
# .device-carry/NAME: CARRY=.device-carry); BUDGET_S (default 570) is the
# whole run's time: the benchmark gets what the steps before it left. RPCS
# (default forward; forward,echo adds Echo rows: the client and transport
# without compute) is python_bench.py's --rpcs; FLOOR=1 adds its grpcio_floor
# rows (grpcio with the request built once and nothing of ours per call: the
# best any client on grpcio could do).
# Usage: scripts/device/gpu-python.sh [--cpu]
set -uo pipefail
if [ -n "${CARRY:-}" ]; then CARRY=$(cd "$CARRY" && pwd) || exit 2; fi
cd "$(dirname "$0")/../.." || exit 1
carry=${CARRY:-$PWD/.device-carry}
budget=${BUDGET_S:-570}
# shellcheck source=scripts/lib/common.sh
. scripts/lib/common.sh
cpu=0
[ "${1:-}" = --cpu ] && cpu=1
OUT=${OUT:-$PWD/gpu-python-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
started=$SECONDS
step() { echo "== $* ($((SECONDS - started)) s)"; }

step "wheels and server"
# The carried libraries (Debian's gRPC, protobuf, Abseil, OpenSSL...) go on the
# library path of the server and attnctl only (pybin's wrappers), not on
# Python's: the machine's own Python modules load the machine's libraries.
use_carried_python "$carry" "$py" || exit 2
commit=$CARRIED_COMMIT
bin="$carry"/pybin

if [ "$cpu" = 1 ]; then
  backend=cpu; device=cpu; gpu=cpu
  server_flags=(--backend=cpu --threads=2)
  export ATTNSERVE_TEST_DEVICE=cpu
  torch_threads=(--threads=1)
  bench_flags=(--quick --scenarios=small --models=llama-small "--batches=1,4" --torch-threads=1)
else
  backend=cuda; device=cuda; gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 |
    tr 'A-Z ' 'a-z-' | sed 's/^nvidia-//')
  server_flags=(--backend=cuda --devices=0 --kv_cache_bytes=$((16 << 30)))
  export ATTNSERVE_TEST_DEVICE=cuda
  torch_threads=()
  bench_flags=("--seconds=2,6")
fi
csv=$OUT/python-$gpu-$(date -u +%Y-%m-%d).csv
rm -f "$csv"

step "environment"
versions=$("$py" - <<'EOF'
import sys, grpc, google.protobuf, numpy, ml_dtypes, torch, transformers, attnserve
from attnserve import _transport
native = (f"native (gRPC C++ {_transport._native.GRPC_VERSION})" if _transport._native
          else f"grpcio only: attnserve._native does not import: {_transport._NATIVE_MISSING}")
print(f"python {sys.version.split()[0]} torch {torch.__version__} (cuda {torch.version.cuda}) "
      f"transformers {transformers.__version__} grpcio {grpc.__version__} "
      f"protobuf {google.protobuf.__version__} numpy {numpy.__version__} "
      f"ml_dtypes {ml_dtypes.__version__} attnserve {attnserve.__version__}, {native}")
EOF
) || { echo "the Python packages do not import (see above)"; exit 2; }
echo "$versions"
{
  echo "# python-$gpu: scripts/device/gpu-python.sh$([ "$cpu" = 1 ] && echo " --cpu") at $(date -u +%FT%TZ), commit $commit"
  [ "$cpu" = 1 ] || nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
    --format=csv,noheader -i 0 | sed 's/^/# gpu: /'
  echo "# cpus $(nproc); $versions"
  echo "# server: attnserve ${server_flags[*]} --log_level=warn"
} >>"$csv"

step "server"
port=$(free_port)
target=127.0.0.1:$port
pid=""
trap '[ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null; wait' EXIT
start_server "$OUT/attnserve.log" 120 "$bin/attnctl" --target="$target" -- \
  "$bin/attnserve" --host=127.0.0.1 --port="$port" --metrics_port=0 --http_port=0 \
  --log_level=warn "${server_flags[@]}" || exit 1
pid=$SERVER_PID
"$bin/attnctl" --target="$target" info | head -20

step "identical tokens (FP32, both modes, model on $device, $backend server)"
fail=0
ATTNSERVE_TARGET=$target timeout 200 "$py" -m pytest -q -p no:cacheprovider \
  python/tests/test_hf.py -k "fp32 or refuses" 2>&1 | tee "$OUT/test-hf.txt" | tail -15
if [ "${PIPESTATUS[0]}" = 0 ]; then result=PASS; else result=FAIL; fail=1; fi
echo "# identical tokens, FP32, 64 greedy tokens, both modes (test_hf.py -k 'fp32 or refuses'): $result ($(tail -1 "$OUT/test-hf.txt"))" >>"$csv"
if [ "$result" = FAIL ]; then  # where, and at what margin
  timeout 200 "$py" -m attnserve.hf_compare --target="$target" --dtype=float32 --no-eager \
    --device="$device" "${torch_threads[@]}" 2>&1 | tee "$OUT/hf-fp32.txt"
  sed 's/^/# fp32: /' "$OUT/hf-fp32.txt" >>"$csv"
fi

step "BF16: first differing token and logit margin"
timeout 200 "$py" -m attnserve.hf_compare --target="$target" --dtype=bfloat16 \
  --device="$device" "${torch_threads[@]}" 2>&1 | tee "$OUT/hf-bf16.txt"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "hf_compare failed"; fail=1; }
sed 's/^/# bf16: /' "$OUT/hf-bf16.txt" >>"$csv"

left=$((budget - (SECONDS - started) - 15))
floor=()
[ "${FLOOR:-0}" = 1 ] && floor=(--floor)
step "benchmark (at most $left s)"
timeout "$left" "$py" bench/gpu/python_bench.py --target="$target" --attnctl="$bin/attnctl" \
  --csv="$csv" --rpcs="${RPCS:-forward}" "${floor[@]}" "${bench_flags[@]}" >"$OUT/bench.txt" 2>&1
rc=$?
[ "$rc" = 0 ] || { echo "python_bench.py exited $rc; its last lines:"; tail -20 "$OUT/bench.txt"; fail=1; }
kill -TERM "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; pid=""

step "results ($csv)"
echo "identical tokens (FP32): $result"
grep -E '^[a-z].*(identical tokens|first differ at)' "$OUT/hf-bf16.txt"
sed -n '/^client throughput/,$p' "$OUT/bench.txt"
exit "$fail"
