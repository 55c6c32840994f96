#!/usr/bin/env bash
# The K/V service's per-step host overhead on the CPU backend, where the shape
# is so small that the kernel is tens of microseconds: one decode step of 2
# sequences (Hq 4, Hkv 1, D 64, FP16, 16-token prompts, pages of 64; 100 tokens
# of 20 layers, so the context stays short and the steps many),
# at concurrency 1, against Echo of the same bytes (q [2,1,4,64], k/v
# [2,1,1,64]):
#   beyond Echo = step p50 - Echo p50 (the server's compute is in it: its
#   mean is printed, but on a loaded host a few slow wake-ups inflate means)
# per transport: unary and one stream, the bytes in the message and in a
# system shared-memory region (--shm=system). Rounds alternate the DIRs
# (bin/attnserve and bin/attnctl, or a build folder's server/ and client/);
# NAME=DIR:FLAG,FLAG runs DIR's server with those flags under NAME, so one
# build can be set against itself (inline=B handoff=B:--inline_max_cost=0).
# PERF=1 also records the server with `perf record -g` during each K/V run
# ($OUT/NAME-rN-CONFIG.perf.data; `perf report -i FILE --no-children`).
# Rows: $OUT/kv-step-cpu.csv (load-kv's and load's columns, label =
# name-round-config); a table is printed last, then each name's and
# configuration's medians over the rounds.
# CONFIGS="unary: stream-shm:--stream,--shm=system" picks configurations
# (label:flags, flags split at commas; the default is all four).
# SHAPE=gpu-bytes moves the GPU decode loop's bytes per step instead (64
# sequences, Hq 32 / Hkv 8 / D 128, BF16: q 512 KiB, k/v 128 KiB each, o 512
# KiB; 1-token prompts, TOKENS (default 24) x 10 layers, so the CPU kernel
# stays short) with Echo of the same bytes: the host's copies of the tensors
# are then the part that moves.
# Usage: [PERF=1] [TOKENS=100] [CONFIGS=...] [SHAPE=gpu-bytes] bench/cpu/kv_step_overhead.sh ROUNDS DIR [DIR...]
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
[ $# -ge 2 ] || { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
OUT=${OUT:-$PWD/kv-step-cpu-out}
mkdir -p "$OUT"
rounds=$1
shift
csv=$OUT/kv-step-cpu.csv
echo_csv=$OUT/echo-cpu.csv
rm -f "$csv" "$echo_csv"
heads=(--heads_q=4 --heads_kv=1 --head_dim=64 --dtype=fp16)
shape=("${heads[@]}" --page_size=64 --sequences=2 --prompt=16 --tokens=${TOKENS:-100}
  --warmup_tokens=5 --layers=20 --prefill_attend=false --concurrency=1)
echo_batch=2
if [ "${SHAPE:-}" = gpu-bytes ]; then
  heads=(--heads_q=32 --heads_kv=8 --head_dim=128 --dtype=bf16)
  shape=("${heads[@]}" --page_size=64 --sequences=64 --prompt=1 --tokens=${TOKENS:-24}
    --warmup_tokens=2 --layers=10 --prefill_attend=false --concurrency=1)
  echo_batch=64
fi
read -r -a configs <<<"${CONFIGS:-unary: stream:--stream unary-shm:--shm=system stream-shm:--stream,--shm=system}"
bin_of() {  # bin_of DIR NAME: the binary NAME in an install-like or a build folder
  if [ -x "$1/bin/$2" ]; then echo "$1/bin/$2"; elif [ "$2" = attnserve ]; then
    echo "$1/server/attnserve"; else echo "$1/client/attnctl"; fi
}
pid=""
trap '[ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null; wait' EXIT
for round in $(seq 1 "$rounds"); do
  for spec in "$@"; do
    dir=${spec#*=}
    extra=()
    if [[ $dir == *:* ]]; then IFS=, read -r -a extra <<<"${dir#*:}"; dir=${dir%%:*}; fi
    if [[ $spec == *=* ]]; then name=${spec%%=*}; else name=$(basename "$dir"); fi
    port=$(free_port)
    ctl=("$(bin_of "$dir" attnctl)" --target="127.0.0.1:$port" --timeout=120s)
    log=$OUT/$name-r$round
    start_server "$log-server.log" 60 "${ctl[@]}" -- "$(bin_of "$dir" attnserve)" --backend=cpu \
      --host=127.0.0.1 --port="$port" --log_level=warn --metrics_port=0 --http_port=0 \
      --allow_client_shm --kv_cache_bytes=$((256 << 20)) "${extra[@]}" ||
      { echo "$name: server did not start"; continue; }
    pid=$SERVER_PID
    for config in "${configs[@]}"; do
      label=${config%%:*}
      IFS=, read -r -a flags <<<"${config#*:}"
      perf_pid=""
      if [ "${PERF:-0}" = 1 ]; then
        perf record -q -g -p "$pid" -o "$log-$label.perf.data" >/dev/null 2>&1 &
        perf_pid=$!
      fi
      "${ctl[@]}" load-kv "${shape[@]}" "${flags[@]}" --csv="$csv" --label="$name-r$round-$label" \
        >"$log-$label.txt" 2>&1 || echo "$name round $round $label failed: $(tail -1 "$log-$label.txt")"
      [ -n "$perf_pid" ] && { kill -INT "$perf_pid"; wait "$perf_pid" 2>/dev/null; }
    done
    "${ctl[@]}" load --rpc=echo --batch=$echo_batch --seqlen_q=1 --seqlen_k=1 "${heads[@]}" --concurrency=1 \
      --warmup=1s --duration=5s --csv="$echo_csv" --label="$name-r$round-echo" \
      >"$log-echo.txt" 2>&1 || echo "$name round $round echo failed: $(tail -1 "$log-echo.txt")"
    kill -TERM "$pid"
    wait "$pid" 2>/dev/null
    pid=""
  done
done
python3 - "$csv" "$echo_csv" <<'EOF'
import csv, sys
def rows(path):
    try:
        return list(csv.DictReader(l for l in open(path) if not l.startswith("#")))
    except FileNotFoundError:
        return []
echo = {r["label"].rsplit("-", 1)[0]: float(r["p50_ms"]) * 1e3 for r in rows(sys.argv[2])}
cols = ("p50", "p99", "echo_p50", "beyond_echo", "queue", "compute", "server", "outside_p50")
by = {}
print(f"{'label (us; queue, compute, server: means)':>44} " + " ".join(f"{c:>11}" for c in cols))
for r in rows(sys.argv[1]):
    label = r["label"]
    run = label.rsplit("-", 2 if label.endswith("-shm") else 1)[0]
    e = echo.get(run)
    v = [float(r["p50_ms"]) * 1e3, float(r["p99_ms"]) * 1e3, e,
         float(r["p50_ms"]) * 1e3 - e if e is not None else None,
         float(r["queue_ms"]) * 1e3, float(r["compute_ms"]) * 1e3,
         float(r["server_total_ms"]) * 1e3, float(r["outside_server_p50_ms"]) * 1e3]
    print(f"{label:>44} " + " ".join(f"{x:11.0f}" if x is not None else f"{'':>11}" for x in v))
    name, rnd, config = run.rsplit("-", 1)[0], run.rsplit("-", 1)[1], label[len(run) + 1:]
    by.setdefault((name, config), []).append(v)
print(f"\nmedians over rounds ({'p50, p99, echo_p50, beyond_echo, queue, compute, server, outside_p50'})")
for (name, config), vs in sorted(by.items()):
    med = []
    for i in range(len(cols)):
        xs = sorted(x[i] for x in vs if x[i] is not None)
        med.append(xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2 if xs else None)
    print(f"{name + ' ' + config + f' ({len(vs)} rounds)':>44} " + " ".join(f"{x:11.0f}" if x is not None else f"{'':>11}" for x in med))
EOF
