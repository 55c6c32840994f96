#!/usr/bin/env bash
# A rolling restart measured: two replicas, each the other's --handoff_peer
# (on a two-GPU machine one GPU each), `attnctl load-kv --check` decoding on
# one K/V cache of SEQS sequences x CONTEXT tokens x LAYERS layers (Hq 32,
# Hkv 8, D 128, BF16, pages of 64) against replica a; once the loop has
# decoded MIN_TOKENS tokens replica a is SIGTERMed (it moves the cache to b
# with --handoff_transport=TRANSPORT, each of TRANSPORTS in turn, RUNS times
# each, and exits) and started again. One CSV row per restart: the loop's longest stall (its slowest layer-step, the
# moved-to retry included), the push's own time and rate and what carried it
# (replica a's "handoff: cache ... moved to ... over ..." log line), the whole
# drain (its "handoff: moved 1 of 1 caches ... in ..." line), the outputs
# checked and wrong (--check's CHECK_FAILED), re-prefills and moved-to
# retries, and whether the target holds: 0 re-prefills, 0 wrong outputs,
# longest stall <= push time + 1 s.
#
# No proxy by default: the loop talks to replica a and follows the moved-to
# address itself (load-kv --moved_to=follow), so nginx is not needed; with
# PROXY=nginx (installed) the loop goes through deploy/proxy's nginx and
# retries moved-to answers through it (--moved_to=retry), whose failover
# adds the drained replica's linger and exit to the stall.
#
# Binaries: bin= (default .device-carry/bin, unpacked from
# .device-carry/pack.tar.xz or .device-carry/server.tgz when present, with
# their lib/ and UCX modules). Both replicas listen for UCX (--ucx_port=-1)
# unless UCX=0. BACKEND=cpu runs it on two CPU servers (bench/cpu/rolling_restart.sh
# does, with small shapes).
# Usage: [SEQS=64] [CONTEXT=8192] [LAYERS=4] [TOKENS=32] [MIN_TOKENS=6]
#        [TRANSPORTS="auto grpc"] [UCX=1] [UCX_TLS=sm,tcp] [RUNS=1] [PROXY=none|nginx]
#        [CHECK=1] [CONCURRENCY=8] [HEADS_Q=32] [HEADS_KV=8] [HEAD_DIM=128] [DTYPE=bf16]
#        [BACKEND=cuda|cpu] [bin=DIR] [OUT=DIR] scripts/device/rolling-restart.sh
# Writes $OUT/rolling-restart.csv and each run's logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/rolling-restart-out}
mkdir -p "$OUT"
if [ -f .device-carry/pack.tar.xz ]; then
  tar -C .device-carry -xJf .device-carry/pack.tar.xz
elif [ -f .device-carry/server.tgz ]; then
  tar -C .device-carry -xzf .device-carry/server.tgz
fi
use_carried_libs lib
[ -d .device-carry/lib/ucx ] && export UCX_MODULE_DIR=$PWD/.device-carry/lib/ucx
export UCX_TLS=${UCX_TLS:-sm,tcp}
bin=${bin:-.device-carry/bin}
SEQS=${SEQS:-64} CONTEXT=${CONTEXT:-8192} LAYERS=${LAYERS:-4} TOKENS=${TOKENS:-32}
MIN_TOKENS=${MIN_TOKENS:-6} TRANSPORTS=${TRANSPORTS:-auto grpc} UCX=${UCX:-1} RUNS=${RUNS:-1}
PROXY=${PROXY:-none} CHECK=${CHECK:-1} CONCURRENCY=${CONCURRENCY:-8}
HEADS_Q=${HEADS_Q:-32} HEADS_KV=${HEADS_KV:-8} HEAD_DIM=${HEAD_DIM:-128} DTYPE=${DTYPE:-bf16}
PAGE=${PAGE:-64} BACKEND=${BACKEND:-cuda}
for b in attnserve attnctl; do
  [ -x "$bin/$b" ] || { echo "no $bin/$b (set bin=)" >&2; exit 2; }
done
if [ "$BACKEND" = cuda ]; then
  gpus=$(nvidia-smi -L | wc -l)
  [ "$gpus" -ge 2 ] || { echo "needs two GPUs, found $gpus" >&2; exit 2; }
fi
if [ "$PROXY" = nginx ] && ! command -v nginx >/dev/null; then
  echo "PROXY=nginx: nginx is not installed" >&2
  exit 2
fi
elt=2; [ "$DTYPE" = fp32 ] && elt=4
# Each replica holds the whole cache (the loop's tokens too; the pool grows
# in slabs of up to 4 GiB, hence the margin).
bytes=$(( SEQS * ((CONTEXT + TOKENS + PAGE - 1) / PAGE * PAGE) * LAYERS * HEADS_KV * HEAD_DIM * 2 * elt ))
pool=$(( bytes + (bytes / 4) + (1 << 30) ))
[ "$BACKEND" = cuda ] && pool=$(( bytes + (8 << 30) ))
check=(); [ "$CHECK" = 1 ] && check=(--check)
ucx=(); [ "$UCX" = 1 ] && ucx=(--ucx_port=-1)

{
  [ "$BACKEND" = cuda ] && nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv | sed 's/^/# /'
  [ "$BACKEND" = cpu ] && echo "# $(uname -srm); $(nproc) CPUs; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
  echo "# commit ${ATTNSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}; backend $BACKEND; $SEQS x $CONTEXT x $LAYERS layers, Hq $HEADS_Q, Hkv $HEADS_KV, D $HEAD_DIM, $DTYPE, pages of $PAGE; $TOKENS tokens decoded, concurrency $CONCURRENCY, check $CHECK; replica a SIGTERMed after $MIN_TOKENS tokens; --handoff_transport each of: $TRANSPORTS; UCX listeners $UCX, UCX_TLS=$UCX_TLS; proxy $PROXY"
  echo "run,proxy,handoff_transport,data_plane,sequences,cache_bytes,push_s,push_gb_per_s,drain_s,stall_ms,p50_ms,outputs_checked,wrong_outputs,reprefills,moved_retries,other_errors,target_met"
} >"$OUT/rolling-restart.csv"

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  wait 2>/dev/null
}
trap cleanup EXIT

for TRANSPORT in $TRANSPORTS; do
for run in $(seq 1 "$RUNS"); do
  dir=$OUT/$TRANSPORT-run$run
  mkdir -p "$dir"
  pa=$(free_port) pb=$(free_port)
  while [ "$pb" = "$pa" ]; do pb=$(free_port); done
  declare -A port=([a]=$pa [b]=$pb) peer=([a]=$pb [b]=$pa) dev=([a]=0 [b]=1) pid=()
  start_replica() {  # start_replica NAME LOG
    local name=$1 log=$2 device=()
    [ "$BACKEND" = cuda ] && device=(--devices="${dev[$name]}")
    start_server "$log" 120 "$bin/attnctl" --target="127.0.0.1:${port[$name]}" --timeout=2s -- \
      "$bin/attnserve" --backend="$BACKEND" --host=127.0.0.1 --port="${port[$name]}" "${device[@]}" \
      --http_port=0 --metrics_port=0 --kv_cache_bytes="$pool" "${ucx[@]}" \
      --handoff_peer="127.0.0.1:${peer[$name]}" --handoff_transport="$TRANSPORT" \
      --shutdown_grace=120s --log_level=info || return 1
    pid[$name]=$SERVER_PID
    pids+=("$SERVER_PID")
  }
  start_replica a "$dir/a.1.log" || exit 1
  start_replica b "$dir/b.log" || exit 1
  target=127.0.0.1:$pa moved_to=follow
  if [ "$PROXY" = nginx ]; then
    pp=$(free_port)
    ATTNSERVE_PROXY_UPSTREAMS="127.0.0.1:$pa 127.0.0.1:$pb" ATTNSERVE_PROXY_PORT=$pp \
    ATTNSERVE_PROXY_FAIL_TIMEOUT=1s ATTNSERVE_PROXY_TEMPLATE=deploy/proxy/nginx.conf.template \
    ATTNSERVE_PROXY_CONF=$dir/nginx.conf sh deploy/proxy/proxy-entrypoint.sh >"$dir/nginx.log" 2>&1 &
    nginx_pid=$!
    pids+=("$nginx_pid")
    wait_until 30 0.1 "$bin/attnctl" --target="127.0.0.1:$pp" --timeout=1s health ||
      { echo "run $run: the nginx proxy did not answer" >&2; exit 1; }
    target=127.0.0.1:$pp moved_to=retry
  fi
  "$bin/attnctl" --target="$target" --timeout=600s load-kv --moved_to="$moved_to" "${check[@]}" \
    --sequences="$SEQS" --prompt="$CONTEXT" --tokens="$TOKENS" --layers="$LAYERS" \
    --heads_q="$HEADS_Q" --heads_kv="$HEADS_KV" --head_dim="$HEAD_DIM" --dtype="$DTYPE" \
    --page_size="$PAGE" --concurrency="$CONCURRENCY" --prefill_attend=false --prefill_chunk=4096 \
    >"$dir/loop.txt" 2>"$dir/loop.err" &
  loop=$!
  pids+=("$loop")
  # The replica holding the cache (behind the proxy either one), once the
  # loop has decoded MIN_TOKENS tokens (its progress line on stderr).
  decoded() {
    local t
    t=$(grep -oE 'decode [0-9]+/' "$dir/loop.err" 2>/dev/null | tail -1 | tr -dc 0-9)
    [ "${t:-0}" -ge $(( MIN_TOKENS * SEQS )) ] || { ! kill -0 "$loop" 2>/dev/null; }
  }
  wait_until 3600 0.2 decoded
  kill -0 "$loop" 2>/dev/null || { echo "run $run: the loop ended before the restart (raise TOKENS)" >&2; cat "$dir/loop.txt" "$dir/loop.err" | tail -5 >&2; exit 1; }
  holder=a
  grep -q "kv cache created" "$dir/b.log" && holder=b
  old=$dir/$holder.1.log; [ "$holder" = b ] && old=$dir/b.log
  echo "run $run: SIGTERM to replica $holder at $(grep -oE 'decode [0-9]+/[0-9]+' "$dir/loop.err" | tail -1) tokens" >&2
  kill -TERM "${pid[$holder]}"
  wait "${pid[$holder]}"
  grep -m1 'handoff: cache .* moved to' "$old" >&2 || grep -m2 'handoff' "$old" >&2
  start_replica "$holder" "$dir/$holder.2.log" || exit 1
  wait "$loop"
  loop_status=$?
  tail -n 8 "$dir/loop.txt" >&2
  python3 - "$run" "$PROXY" "$TRANSPORT" "$old" "$dir/loop.txt" "$loop_status" \
    >>"$OUT/rolling-restart.csv" <<'EOF'
import re, sys
run, proxy, transport, log, loop, status = sys.argv[1:]
a = open(log).read()
t = open(loop).read()
push = re.search(r"handoff: cache \S+ \(tenant \S+\) moved to \S+ over (\w+): (\d+) sequences, "
                 r"(\d+) bytes in ([\d.]+) s \(([\d.]+) GB/s\)", a)
drain = re.search(r"handoff: moved (\d+) of (\d+) caches to \S+ in (\S+)", a)
def seconds(d):  # absl::FormatDuration: 1.5s, 850ms, 1m2.5s, 120us
    total = 0.0
    for v, u in re.findall(r"([\d.]+)(h|m(?!s)|s|ms|us|ns)", d):
        total += float(v) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[u]
    return total
step = re.search(r"p50 ([\d.]+) ms, p99 [\d.]+ ms, max ([\d.]+) ms", t)
checked = re.search(r"check: (\d+) outputs", t)
moved = re.search(r"moved caches: (\d+) retries after moved-to, (\d+) re-prefills", t)
errs = dict((k, int(v)) for k, v in re.findall(r"([A-Z_]+)=(\d+)", (re.search(r"errors: (.*)", t) or [None, ""])[1]))
wrong = errs.pop("CHECK_FAILED", 0)
other = sum(errs.values()) + (0 if status == "0" else 1)
push_s = float(push.group(4)) if push else float("nan")
stall = float(step.group(2)) if step else float("nan")
reprefills = int(moved.group(2)) if moved else -1
met = push is not None and reprefills == 0 and wrong == 0 and other == 0 and stall <= (push_s + 1) * 1e3
print(",".join([run, proxy, transport, push.group(1) if push else "none",
                push.group(2) if push else "0", push.group(3) if push else "0",
                "%.3f" % push_s, push.group(5) if push else "0",
                "%.3f" % seconds(drain.group(3)) if drain else "", "%.1f" % stall,
                step.group(1) if step else "", checked.group(1) if checked else "0", str(wrong),
                str(reprefills), moved.group(1) if moved else "", str(other),
                "yes" if met else "no"]))
EOF
  for p in "${pid[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${pid[@]}"; do wait "$p" 2>/dev/null; done
  [ "$PROXY" = nginx ] && { kill -TERM "$nginx_pid" 2>/dev/null; wait "$nginx_pid" 2>/dev/null; }
done
done
grep -v '^#' "$OUT/rolling-restart.csv" | tr , '\t'
