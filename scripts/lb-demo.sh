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
# The client is `attnctl load` (one AttentionClient, one channel, many calls).
# For contrast the demo also runs one-shot `attnctl forward` processes: a fresh
# channel sends its first call to whichever subchannel connects first, so
# one-shot processes spread unevenly.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/lb-demo.sh [--seconds N] [--build-dir DIR]

  --seconds N      how long `attnctl load` sends calls on one round_robin channel (default 2)
  --build-dir DIR  where attnserve and attnctl are built (default build-deploy;
                   configured and built there if missing, CPU backend only)
EOF
}

cd "$(dirname "$0")/.."
seconds=2
build_dir=build-deploy
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --seconds=*) seconds=${1#*=}; shift ;;
    --build-dir) build_dir=$2; shift 2 ;;
    --build-dir=*) build_dir=${1#*=}; shift ;;
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
tmp=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT

# Port 0: each server picks a free port and logs it. No HTTP or /metrics
# ports (two servers cannot share them), and debug logging, which has the
# per-call 'forward id=' lines count() reads.
start_server() {  # start_server NAME
  "$server" --host=127.0.0.1 --port=0 --threads=1 --http_port=0 --metrics_port=0 \
    --log_level=debug >"$tmp/$1.log" 2>&1 &
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

# 1. One client, one channel, round_robin: attnctl load for a few seconds,
# every response checked against the reference.
"$ctl" --target="$target" --lb_policy=round_robin --wait_for_ready load --concurrency=2 \
  --warmup=0s --duration="${seconds}s" --seqlen_q=16 --heads_q=2 --head_dim=8 --check \
  2>/dev/null | tail -n 3
a1=$(count a); b1=$(count b)
requests=$((a1 + b1))
echo "lb-demo: one channel, round_robin (attnctl load, ${seconds} s): $requests calls:" \
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

# Both servers must have served a fair share (round_robin alternates, and two
# callers can be one call apart at the end of the window).
low=$(( requests / 2 - 2 ))
if [ "$requests" -gt 0 ] && [ "$a1" -ge "$low" ] && [ "$b1" -ge "$low" ]; then
  echo "lb-demo: PASS (round_robin spread $requests calls as $a1 / $b1)"
else
  echo "lb-demo: FAIL (expected about $((requests / 2)) calls on each server, got $a1 / $b1)"
  exit 1
fi
