#!/usr/bin/env bash
# TLS cost on this machine: attnctl load against one CPU server in plain text
# and one with TLS (and a bearer token), for a large request and a small one,
# rounds interleaved so that load from other processes hits both alike.
# Writes one CSV row per run (attnctl's --csv columns, labelled
# "<plain|tls>-<small|large>-<round>") and prints the median req/s of each
# and the TLS/plain ratio.
#   scripts/tls-bench.sh [BUILD_DIR] [ROUNDS] [OUT_CSV]
# RPC: Echo (validation and a copy of q, no compute), so the transport is
# what is measured: the worst case for TLS. ATTNSERVE_TLS_BENCH_RPC=forward
# measures Forward instead (end to end with the CPU backend's compute; its
# large request is smaller, 12 MiB, so that a call takes seconds, not minutes).
# ATTNSERVE_TLS_BENCH_COST=1 measures CPU instead of throughput: one caller,
# each run twice (2 s and 10 s, no warm-up) so that attnctl's start-up (input
# generation) cancels out; the server's CPU comes from /proc, attnctl's from
# /usr/bin/time. It prints CPU milliseconds per request for server and client,
# plain and TLS (OUT_CSV default bench/results/tls-cpu-cost.csv). On a loaded
# machine throughput swings by +-40% a round; CPU per request is steadier and
# says whether TLS is slower because it works more or because it waits.
set -euo pipefail
build=${1:-build}
rounds=${2:-3}
cost=${ATTNSERVE_TLS_BENCH_COST:-0}
if [[ $cost == 1 ]]; then out=${3:-bench/results/tls-cpu-cost.csv}; else out=${3:-bench/results/tls-cpu.csv}; fi
rpc=${ATTNSERVE_TLS_BENCH_RPC:-echo}
dir=$(mktemp -d "${TMPDIR:-/tmp}/tls-bench.XXXXXX")
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null; rm -rf "$dir"; }
trap cleanup EXIT

"$build/tests/security/make_test_certs" "$dir"
token=tls-bench-token-0123456789abcdef
echo "$token bench" >"$dir/tokens"

# Starts a server (extra flags) in the background of this shell (not in a
# $(...) subshell, so that its pid lands in pids and cleanup stops it).
start() {
  local log=$dir/server-$1.log; shift
  "$build/server/attnserve" --host=127.0.0.1 --port=0 --metrics_port=0 --http_port=0 \
    --backend=cpu --threads=1 "$@" >"$log" 2>&1 &
  pids+=($!)
}
# Prints the port of server NAME once it has logged it.
port_of() {
  local log=$dir/server-$1.log
  for _ in $(seq 1 1200); do
    local port
    port=$(sed -n 's/.*listening on [^ ]*:\([0-9][0-9]*\) .*/\1/p' "$log" | head -1)
    if [[ -n $port ]]; then echo "$port"; return; fi
    sleep 0.1  # poll interval while reading the log
  done
  echo "server did not start: $(cat "$log")" >&2; exit 1
}
start plain
start tls --tls_cert="$dir/server.pem" --tls_key="$dir/server.key" --auth_tokens_file="$dir/tokens"
plain_port=$(port_of plain)
tls_port=$(port_of tls)

# Large: q, k, v FP16 [1, 4096, 16, 128] (16 MiB each, 48 MiB a request);
# small: [1, 16, 2, 32] (2 KiB each).
declare -A shape=(
  [large]="--batch=1 --seqlen_q=4096 --heads_q=16 --heads_kv=16 --head_dim=128 --dtype=fp16"
  [small]="--batch=1 --seqlen_q=16 --heads_q=2 --heads_kv=2 --head_dim=32 --dtype=fp16")
duration=5s
if [[ $rpc == forward ]]; then
  shape[large]="--batch=1 --seqlen_q=1024 --heads_q=16 --heads_kv=16 --head_dim=128 --dtype=fp16"
  duration=10s
fi
declare -A conc=([large]=2 [small]=8)
mkdir -p "$(dirname "$out")"
rm -f "$out"

# Cost mode: CPU seconds of the server (utime+stime ticks from /proc) and of
# attnctl over one run, and the requests it completed.
if [[ $cost == 1 ]]; then
  hz=$(getconf CLK_TCK)
  cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
  echo "label,mode,size,seconds,requests,server_cpu_s,client_cpu_s" >"$out"
  for round in $(seq 1 "$rounds"); do
    for size in large small; do
      for mode in plain tls; do
        for secs in 2 10; do
          if [[ $mode == plain ]]; then
            sec=(--target="127.0.0.1:$plain_port"); spid=${pids[0]}
          else
            sec=(--target="localhost:$tls_port" --tls_ca="$dir/ca.pem" --token="$token"); spid=${pids[1]}
          fi
          rm -f "$dir/run.csv"
          t0=$(cpu_ticks "$spid")
          # shellcheck disable=SC2086
          /usr/bin/time -q -f "%U %S" -o "$dir/time" "$build/client/attnctl" "${sec[@]}" load \
            --rpc="$rpc" --concurrency=1 --warmup=0s --duration="${secs}s" ${shape[$size]} \
            --csv="$dir/run.csv" >/dev/null 2>&1 || true  # exits 1 when no request completed
          t1=$(cpu_ticks "$spid")
          requests=0
          if [[ -f $dir/run.csv ]]; then
            requests=$(python3 -c 'import csv,sys; print(list(csv.DictReader(open(sys.argv[1])))[-1]["requests"])' "$dir/run.csv")
          fi
          read -r user system <"$dir/time"
          echo "$mode-$size-$round-$secs,$mode,$size,$secs,$requests,$(awk -v t=$((t1 - t0)) -v hz="$hz" 'BEGIN{print t / hz}'),$(awk -v u="$user" -v s="$system" 'BEGIN{print u + s}')" >>"$out"
        done
      done
    done
  done
  python3 - "$out" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
# Per request: (long run - short run) / (its extra requests), per round; median over rounds.
per = {}
for r in rows:
    per.setdefault((r["mode"], r["size"], r["label"].split("-")[2]), {})[r["seconds"]] = r
for size in ("large", "small"):
    res = {}
    for mode in ("plain", "tls"):
        srv, cli = [], []
        for (m, s, _), runs in per.items():
            if (m, s) != (mode, size) or len(runs) != 2:
                continue
            dn = int(runs["10"]["requests"]) - int(runs["2"]["requests"])
            if dn <= 0:
                continue
            srv.append(1e3 * (float(runs["10"]["server_cpu_s"]) - float(runs["2"]["server_cpu_s"])) / dn)
            cli.append(1e3 * (float(runs["10"]["client_cpu_s"]) - float(runs["2"]["client_cpu_s"])) / dn)
        res[mode] = (statistics.median(srv), statistics.median(cli)) if srv else (float("nan"),) * 2
        print(f"{size:6s} {mode:5s} CPU per request: server {res[mode][0]:8.3f} ms  client {res[mode][1]:8.3f} ms")
    print(f"{size:6s} TLS/plain CPU per request: server {res['tls'][0] / res['plain'][0]:.2f}x"
          f"  client {res['tls'][1] / res['plain'][1]:.2f}x")
PY
  exit 0
fi

for round in $(seq 1 "$rounds"); do
  for size in large small; do
    for mode in plain tls; do
      if [[ $mode == plain ]]; then
        sec=(--target="127.0.0.1:$plain_port")
      else
        sec=(--target="localhost:$tls_port" --tls_ca="$dir/ca.pem" --token="$token")
      fi
      rm -f "$dir/run.csv"  # attnctl appends
      # shellcheck disable=SC2086
      "$build/client/attnctl" "${sec[@]}" load --rpc="$rpc" --concurrency="${conc[$size]}" \
        --warmup=1s --duration="$duration" ${shape[$size]} --label="$mode-$size-$round" \
        --csv="$dir/run.csv" >/dev/null 2>&1
      if [[ ! -f $out ]]; then head -1 "$dir/run.csv" >"$out"; fi
      tail -n +2 "$dir/run.csv" >>"$out"
    done
  done
done

python3 - "$out" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
print("rounds (req/s):", ", ".join(f"{r['label']} {float(r['req_per_s']):.1f}" for r in rows))
med = {}
for size in ("large", "small"):
    for mode in ("plain", "tls"):
        v = [float(r["req_per_s"]) for r in rows if r["label"].startswith(f"{mode}-{size}-")]
        med[mode, size] = statistics.median(v)
    ratio = med["tls", size] / med["plain", size]
    print(f"{size:6s} plain {med['plain', size]:10.1f} req/s  tls {med['tls', size]:10.1f} req/s"
          f"  tls/plain {ratio:.3f}")
PY
