#!/usr/bin/env bash
# On the GPU machine: the Python client's throughput in every form against
# `attnctl load` on one CUDA server, nothing else (scripts/device/gpu-python.sh
# runs this and the transformers checks; this is the short run for the
# "Python >= 0.9x attnctl" target).
#   bench/gpu/python_bench.py --parts=client: small (B 1, N 256, H 16, D 128)
#   and large (B 4, N 4096) Forward requests at concurrency 1 and 16; per
#   point attnctl load, then the Python client as unary calls from threads, one
#   ForwardStream, AsyncClient coroutines and one AsyncForwardStream, each on
#   the native transport (attnserve._native, gRPC C++) and on grpcio.
#   REPS rounds (default 2), so a drift of the machine shows as a spread.
#   Before them: python/tests/test_shm.py against this server (started with
#   --allow_client_shm): system shm and, with torch on the GPU, CUDA IPC regions
#   (the CUDA case is skipped without them), and bench/gpu/python_shm_ab.py
#   (append-and-attend with the bytes in the message vs system shm, per transport).
# Carry: .device-carry/wheels (scripts/device/pack-python-carry.sh; the
# attnserve wheel with attnserve._native) and .device-carry/bin + lib or
# .device-carry/server.tgz (scripts/device/pack-device-deps.sh --server BUILD,
# or pack-python-carry.sh --bundle). Rows go to $OUT/python-forms-<gpu>-<date>.csv
# (environment as `#` lines); the summary table is printed last.
# Environment: PYTHON (default python3), SECONDS_ (warm-up,measured; default
# 2,6), REPS (default 2), RPCS (default forward; forward,echo adds Echo rows,
# unary forms only), BUDGET_S (default 560: the bench stops there).
# --cpu: the same against a CPU server here (small requests, Echo and Forward),
# to try the script before the GPU run.
# Usage: scripts/device/python-bench.sh [--cpu]
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
carry=${CARRY:-$PWD/.device-carry}
budget=${BUDGET_S:-560}
# shellcheck source=scripts/lib/common.sh
. scripts/lib/common.sh
cpu=0
[ "${1:-}" = --cpu ] && cpu=1
OUT=${OUT:-$PWD/python-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
started=$SECONDS
step() { echo "== $* ($((SECONDS - started)) s)"; }

step "wheels and server"
# The carried libraries go on the server's and attnctl's library path only
# (pybin's wrappers; the machine's Python loads its own).
use_carried_python "$carry" "$py" || exit 2
commit=$CARRIED_COMMIT
bin="$carry"/pybin

if [ "$cpu" = 1 ]; then
  gpu=cpu
  server_flags=(--backend=cpu --threads=2 --allow_client_shm)
  bench_flags=(--scenarios=small --rpcs="${RPCS:-echo,forward}" --concurrency=1,16)
else
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 | tr 'A-Z ' 'a-z-' |
    sed 's/^nvidia-//')
  server_flags=(--backend=cuda --devices=0 --allow_client_shm)
  bench_flags=(--scenarios=small,large --rpcs="${RPCS:-forward}" --concurrency=1,16)
fi
csv=$OUT/python-forms-$gpu-$(date -u +%Y-%m-%d).csv
rm -f "$csv"
versions=$("$py" - <<'EOF'
import sys, grpc, google.protobuf, numpy, attnserve
from attnserve import _transport
native = (f"native (gRPC C++ {_transport._native.GRPC_VERSION})" if _transport._native
          else f"grpcio only: attnserve._native does not import: {_transport._NATIVE_MISSING}")
print(f"python {sys.version.split()[0]} grpcio {grpc.__version__} protobuf "
      f"{google.protobuf.__version__} numpy {numpy.__version__} attnserve "
      f"{attnserve.__version__}, {native}")
EOF
) || { echo "the Python packages do not import (see above)"; exit 2; }
echo "$versions"
{
  echo "# python-forms-$gpu: scripts/device/python-bench.sh$([ "$cpu" = 1 ] && echo " --cpu") at $(date -u +%FT%TZ), wheels of commit $commit"
  [ "$cpu" = 1 ] || nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv,noheader -i 0 | sed 's/^/# gpu: /'
  echo "# cpus $(nproc); $versions"
  echo "# server: attnserve ${server_flags[*]} --log_level=warn; server and client on one host"
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

fail=0
step "shared memory: test_shm.py, then python_shm_ab.py"
ATTNSERVE_TARGET=$target timeout 300 "$py" -m pytest -q -p no:cacheprovider -rs \
  python/tests/test_shm.py >"$OUT/test-shm.txt" 2>&1 || fail=1
tail -8 "$OUT/test-shm.txt"
for transport in native grpcio; do
  ATTNSERVE_TRANSPORT=$transport timeout 200 "$py" bench/gpu/python_shm_ab.py "$target" \
    2>&1 | tee -a "$OUT/shm-ab.txt" | tail -3
done
for rep in $(seq 1 "${REPS:-2}"); do
  left=$((budget - (SECONDS - started) - 10))
  [ "$left" -gt 30 ] || { echo "budget spent before round $rep"; break; }
  step "round $rep (at most $left s)"
  timeout "$left" "$py" bench/gpu/python_bench.py --target="$target" --attnctl="$bin/attnctl" \
    --csv="$csv" --parts=client --seconds="${SECONDS_:-2,6}" --label="rep$rep" \
    --forms=unary,stream,async,async_stream \
    "${bench_flags[@]}" >"$OUT/bench-rep$rep.txt" 2>&1 ||
    { echo "python_bench.py round $rep failed; its last lines:"; tail -20 "$OUT/bench-rep$rep.txt"; fail=1; }
  grep '^  ' "$OUT/bench-rep$rep.txt"
done
kill -TERM "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; pid=""

step "results ($csv)"
"$py" -c 'import sys; sys.path.insert(0, "bench/gpu"); import python_bench as b; b.print_summary(sys.argv[1])' "$csv"
exit "$fail"
