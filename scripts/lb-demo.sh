#!/usr/bin/env bash
# Client-side load balancing on loopback: starts two attnserve servers on
# 127.0.0.1 (ports A and B), sends N Forward calls from ONE gRPC channel whose
# target lists both (ipv4:127.0.0.1:A,127.0.0.1:B) with the round_robin
# policy, and prints how many requests each server logged. This is what a
# client does in Kubernetes with dns:///attnserve-headless.NS.svc.cluster.local:50051:
# the DNS name of the headless Service resolves to one address per ready pod,
# all on port 50051, and round_robin keeps a subchannel to each. On loopback
# the two servers need two ports, and a DNS name cannot carry a port per
# address, so the demo hands the resolver the same address list directly
# (gRPC's ipv4: scheme); from there the round_robin code path is the same.
#
# The single-channel client is a short Python gRPC program (grpcio from PyPI,
# stubs generated from proto/ at run time), because `attnctl forward` makes
# one call per process: a fresh channel sends its first call to whichever
# subchannel connects first, so N processes mostly hit one server. The demo
# shows that too. Once `attnctl load` (many calls on one client) lands, it can
# replace the Python client: attnctl load --target=ipv4:... --lb_policy=round_robin.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/lb-demo.sh [--requests N] [--build-dir DIR] [--venv DIR]

  --requests N     calls on the single round_robin channel (default 40)
  --build-dir DIR  where attnserve and attnctl are built (default build-deploy;
                   configured and built there if missing, CPU backend only)
  --venv DIR       Python virtual environment for grpcio (default build-deploy/venv)
EOF
}

cd "$(dirname "$0")/.."
requests=40
build_dir=build-deploy
venv=build-deploy/venv
while [ $# -gt 0 ]; do
  case "$1" in
    --requests) requests=$2; shift 2 ;;
    --requests=*) requests=${1#*=}; shift ;;
    --build-dir) build_dir=$2; shift 2 ;;
    --build-dir=*) build_dir=${1#*=}; shift ;;
    --venv) venv=$2; shift 2 ;;
    --venv=*) venv=${1#*=}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "lb-demo: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
die() { echo "lb-demo: $*" >&2; exit 1; }

server=$build_dir/server/attnserve
ctl=$build_dir/client/attnctl
if [ ! -x "$server" ] || [ ! -x "$ctl" ]; then
  echo "lb-demo: building attnserve and attnctl in $build_dir"
  cmake -S . -B "$build_dir" -G Ninja -DATTNSERVE_CUDA=OFF \
    -DATTNSERVE_BUILD_TESTS=OFF -DATTNSERVE_BUILD_BENCH=OFF >/dev/null
  cmake --build "$build_dir" -j "$(nproc)" --target attnserve attnctl
fi
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import grpc, grpc_tools' 2>/dev/null; then
  echo "lb-demo: installing grpcio grpcio-tools into $venv"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q grpcio grpcio-tools
fi

tmp=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT

# Port 0: each server picks a free port and logs it.
start_server() {  # start_server NAME
  "$server" --host=127.0.0.1 --port=0 --threads=1 >"$tmp/$1.log" 2>&1 &
  pids+=($!)
}
port_of() {  # port_of NAME: waits for the "listening on HOST:PORT" line
  local p=""
  for _ in $(seq 1 100); do
    p=$(grep -o -m1 'listening on [0-9.]*:[0-9]*' "$tmp/$1.log" 2>/dev/null | awk -F: '{print $NF}') || true
    [ -n "$p" ] && { echo "$p"; return; }
    sleep 0.1
  done
  cat "$tmp/$1.log" >&2
  die "server $1 did not start"
}
count() { grep -c 'forward id=' "$tmp/$1.log" || true; }

start_server a
start_server b
port_a=$(port_of a)
port_b=$(port_of b)
target="ipv4:127.0.0.1:$port_a,127.0.0.1:$port_b"
echo "lb-demo: server A on 127.0.0.1:$port_a, server B on 127.0.0.1:$port_b"
echo "lb-demo: target $target"

# 1. One channel, round_robin, N calls.
"$venv/bin/python" -m grpc_tools.protoc -Iproto --python_out="$tmp" --grpc_python_out="$tmp" \
  proto/attnserve/v1/attention.proto
start=$(date +%s.%N)
PYTHONPATH=$tmp "$venv/bin/python" - "$target" "$requests" <<'EOF'
# One gRPC channel with the round_robin policy; N small FP32 Forward calls.
import struct
import sys

import grpc
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc

target, n = sys.argv[1], int(sys.argv[2])
channel = grpc.insecure_channel(target, options=[("grpc.lb_policy_name", "round_robin")])
# Wait for the channel (round_robin: at least one subchannel) to be ready, so
# the first calls do not fail fast while connections are being made.
grpc.channel_ready_future(channel).result(timeout=10)
stub = pb_grpc.AttentionStub(channel)
shape = [1, 16, 2, 8]  # B, S, H, D
data = struct.pack("<%df" % (16 * 2 * 8), *[((i * 37) % 17) / 17.0 - 0.5 for i in range(16 * 2 * 8)])
tensor = pb.Tensor(dtype=pb.FP32, shape=shape, data=data)
for i in range(n):
    stub.Forward(pb.ForwardRequest(request_id="lb-%d" % i, q=tensor, k=tensor, v=tensor),
                 timeout=30, wait_for_ready=True)
print("lb-demo: %d calls on one round_robin channel: all OK" % n)
EOF
elapsed=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
a1=$(count a); b1=$(count b)
echo "lb-demo: one channel, round_robin (grpc.lb_policy_name), $requests calls in $elapsed s:" \
     "server A $a1, server B $b1"

# 2. For contrast: attnctl, one call per process (a fresh channel each time).
n2=10
for i in $(seq 1 "$n2"); do
  "$ctl" --target="$target" --lb_policy=round_robin forward --seqlen_q=16 --heads_q=2 \
    --head_dim=8 --request_id="attnctl-$i" >/dev/null
done
a2=$(( $(count a) - a1 )); b2=$(( $(count b) - b1 ))
echo "lb-demo: $n2 attnctl processes (one call each), --lb_policy=round_robin:" \
     "server A $a2, server B $b2 (a fresh channel's first call goes to the first" \
     "subchannel that connects, so one-shot processes spread unevenly)"

# Both servers must have served a fair share of the single-channel calls.
low=$(( requests / 2 - 1 ))
if [ "$a1" -ge "$low" ] && [ "$b1" -ge "$low" ] && [ $((a1 + b1)) -eq "$requests" ]; then
  echo "lb-demo: PASS (round_robin spread $requests calls as $a1 / $b1)"
else
  echo "lb-demo: FAIL (expected about $((requests / 2)) calls on each server, got $a1 / $b1)"
  exit 1
fi
