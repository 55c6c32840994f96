#!/usr/bin/env bash
# A rolling restart mid decode loop loses no sequence (deploy/README.md): two CPU
# attnserve replicas on 127.0.0.1, each naming the other with --handoff_peer,
# and `attnctl load-kv --check` decoding on one K/V cache. The replica that
# holds the cache is sent SIGTERM mid-loop (it moves the cache to its peer and
# answers moved-to) and started again. Passes when the loop ends with every
# output checked against the float64 reference, no error, no re-prefill, and
# at least one call that followed the move; prints the loop's longest stall
# (its slowest layer-step, retries included).
#
# With nginx installed (deploy/proxy's configuration, through its entrypoint)
# the loop talks to the proxy and retries moved-to answers through it
# (--moved_to=retry); the proxy sends the calls to the peer once the drained
# replica is gone, and back to the restarted replica after its fail timeout,
# where the cache is fetched from the peer. Without nginx (or --proxy=none)
# the loop talks to the replica directly and follows the moved-to address.
# --proxy=nginx fails when nginx is missing (ctest runs it so: the proxy path
# must not be skipped silently); --proxy=auto is for people.
# Every wait waits for a log line or an exit, with a deadline.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/rolling-restart-demo.sh [--build-dir DIR] [--proxy auto|nginx|none] [--tokens N]

  --build-dir DIR  where attnserve and attnctl are built (default build-deploy;
                   configured and built there if missing, CPU backend only)
  --proxy MODE     auto (nginx when installed), nginx, or none (default auto)
  --tokens N       tokens the loop generates per sequence (default 3000; the
                   loop must outlast the restart)
EOF
}

cd "$(dirname "$0")/.."
build_dir=build-deploy
proxy=auto
tokens=3000
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) build_dir=$2; shift 2 ;;
    --build-dir=*) build_dir=${1#*=}; shift ;;
    --proxy) proxy=$2; shift 2 ;;
    --proxy=*) proxy=${1#*=}; shift ;;
    --tokens) tokens=$2; shift 2 ;;
    --tokens=*) tokens=${1#*=}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "rolling-restart: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
die() { echo "rolling-restart: FAIL: $*" >&2; exit 1; }
say() { echo "rolling-restart: $*"; }

server=$build_dir/server/attnserve
ctl=$build_dir/client/attnctl
if [ ! -x "$server" ] || [ ! -x "$ctl" ]; then
  say "building attnserve and attnctl in $build_dir"
  cmake -S . -B "$build_dir" -G Ninja -DATTNSERVE_CUDA=OFF \
    -DATTNSERVE_BUILD_TESTS=OFF -DATTNSERVE_BUILD_BENCH=OFF >/dev/null
  cmake --build "$build_dir" -j "$(nproc)" --target attnserve attnctl
fi
# Debian installs nginx in /usr/sbin, which a non-root user's PATH leaves out.
PATH=$PATH:/usr/sbin:/sbin
case "$proxy" in
  auto) if command -v nginx >/dev/null; then proxy=nginx; else proxy=none; fi ;;
  nginx) command -v nginx >/dev/null || die "--proxy=nginx: nginx is not installed" ;;
  none) ;;
  *) echo "rolling-restart: --proxy: expected auto, nginx or none, got '$proxy'" >&2; exit 2 ;;
esac

tmp=$(mktemp -d)
declare -A pid=()
loop_pid=""
cleanup() {
  [ -n "$loop_pid" ] && kill -TERM "$loop_pid" 2>/dev/null || true
  for name in "${!pid[@]}"; do kill -TERM "${pid[$name]}" 2>/dev/null || true; done
  for name in "${!pid[@]}"; do wait "${pid[$name]}" 2>/dev/null || true; done
  if [ "${keep_logs:-0}" = 1 ]; then echo "rolling-restart: logs kept in $tmp" >&2; else rm -rf "$tmp"; fi
}
trap cleanup EXIT

# Free ports, chosen up front: each replica must name the other's.
read -r port_a port_b port_p < <(python3 - <<'EOF'
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])
EOF
)
declare -A port=([a]=$port_a [b]=$port_b)
declare -A peer=([a]=b [b]=a)
declare -A runs=([a]=0 [b]=0)

# wait_for DESCRIPTION SECONDS COMMAND...: polls COMMAND until it succeeds.
wait_for() {
  local what=$1 seconds=$2; shift 2
  local deadline=$((SECONDS + seconds))
  until "$@"; do
    if [ "$SECONDS" -ge "$deadline" ]; then keep_logs=1; die "no $what after ${seconds} s"; fi
    if [ -n "$loop_pid" ] && ! kill -0 "$loop_pid" 2>/dev/null && [ "${loop_may_end:-0}" != 1 ]; then
      keep_logs=1
      cat "$tmp/loop.out" >&2
      die "the loop ended before $what (raise --tokens)"
    fi
    sleep 0.05
  done
}
log_of() { echo "$tmp/$1.${runs[$1]}.log"; }
has_line() { grep -q -- "$2" "$1" 2>/dev/null; }

start_replica() {  # start_replica NAME
  local name=$1
  runs[$name]=$((runs[$name] + 1))
  "$server" --host=127.0.0.1 --port="${port[$name]}" --threads=1 --http_port=0 --metrics_port=0 \
    --handoff_peer="127.0.0.1:${port[${peer[$name]}]}" --shutdown_grace=20s \
    --log_level=debug >"$(log_of "$name")" 2>&1 &
  pid[$name]=$!
  wait_for "'listening on' from replica $name" 30 has_line "$(log_of "$name")" "listening on"
}

start_replica a
start_replica b
say "replica a on 127.0.0.1:$port_a, replica b on 127.0.0.1:$port_b (each the other's peer)"

if [ "$proxy" = nginx ]; then
  ATTNSERVE_PROXY_UPSTREAMS="127.0.0.1:$port_a 127.0.0.1:$port_b" \
  ATTNSERVE_PROXY_PORT=$port_p ATTNSERVE_PROXY_FAIL_TIMEOUT=1s \
  ATTNSERVE_PROXY_TEMPLATE=deploy/proxy/nginx.conf.template \
  ATTNSERVE_PROXY_CONF=$tmp/nginx.conf \
    sh deploy/proxy/proxy-entrypoint.sh >"$tmp/nginx.log" 2>&1 &
  pid[nginx]=$!
  proxy_up() { "$ctl" --target="127.0.0.1:$port_p" --timeout=1s health >/dev/null 2>&1; }
  wait_for "answer from the nginx proxy on port $port_p" 30 proxy_up
  target=127.0.0.1:$port_p
  moved_to=retry
  say "nginx affinity proxy on 127.0.0.1:$port_p (deploy/proxy), loop retries through it"
else
  target=127.0.0.1:$port_a
  moved_to=follow
  say "no proxy: the loop talks to replica a and follows moved-to addresses"
fi

"$ctl" --target="$target" load-kv --moved_to="$moved_to" --check --concurrency=2 --sequences=4 \
  --prompt=40 --tokens="$tokens" --layers=2 --heads_q=4 --heads_kv=2 --head_dim=16 --dtype=fp16 \
  >"$tmp/loop.out" 2>"$tmp/loop.err" &
loop_pid=$!

# The replica that holds the cache: the one that logged its creation.
created() {
  for name in a b; do
    if has_line "$(log_of "$name")" "kv cache created"; then holder=$name; return 0; fi
  done
  return 1
}
wait_for "cache creation on either replica" 30 created
cache_id=$(grep -o -m1 'kv cache created id=[^ ]*' "$(log_of "$holder")" | cut -d= -f2)
steps() { grep -c 'kv append_attend' "$1" 2>/dev/null || true; }
decoding() { [ "$(steps "$(log_of "$holder")")" -ge 100 ]; }
wait_for "decode steps on replica $holder" 60 decoding
say "cache $cache_id is on replica $holder; decoding ($(steps "$(log_of "$holder")") steps so far)"

# SIGTERM the holder mid-loop: it moves the cache to its peer, then exits.
old_log=$(log_of "$holder")
kill -TERM "${pid[$holder]}"
wait_for "'handoff: moved' from replica $holder" 30 has_line "$old_log" "handoff: moved 1 of 1 caches"
wait "${pid[$holder]}" || die "replica $holder exited $? after SIGTERM"
say "replica $holder: $(grep -o -m1 'handoff: cache .* moved to .*' "$old_log" || true)"
say "replica $holder: $(grep -o -m1 'handoff: moved .*' "$old_log")"

start_replica "$holder"
say "replica $holder restarted"
if [ "$proxy" = nginx ]; then
  # Once the proxy's fail timeout is over, the cache's calls reach the
  # restarted replica again, which fetches the cache from its peer.
  wait_for "'fetched from' on the restarted replica $holder" 60 \
    has_line "$(log_of "$holder")" "handoff: cache $cache_id (tenant default) fetched from"
  say "replica $holder: $(grep -o -m1 'handoff: cache .* fetched from .*' "$(log_of "$holder")")"
fi

loop_may_end=1
loop_status=0
wait "$loop_pid" || loop_status=$?
loop_pid=""
cat "$tmp/loop.out"
summary=$(grep -o 'moved caches: [0-9]* retries after moved-to, [0-9]* re-prefills' "$tmp/loop.out" || true)
retries=$(echo "$summary" | awk '{print $3}')
reprefills=$(echo "$summary" | awk '{print $7}')
stall=$(grep -o -m1 'max [0-9.]* ms' "$tmp/loop.out" | awk '{print $2}')
checked=$(grep -o -m1 'check: [0-9]* outputs' "$tmp/loop.out" | awk '{print $2}')
if [ "$loop_status" -ne 0 ] || [ -z "$summary" ] || [ "$reprefills" != 0 ] || \
   [ "${retries:-0}" -lt 1 ] || grep -q 'errors:' "$tmp/loop.out"; then
  keep_logs=1
  cat "$tmp/loop.err" >&2
  die "loop exit $loop_status, ${retries:-?} moved-to retries, ${reprefills:-?} re-prefills"
fi
say "PASS: $checked outputs checked, 0 wrong, 0 re-prefills, $retries calls retried after" \
    "moved-to; longest stall (slowest layer-step) $stall ms"
