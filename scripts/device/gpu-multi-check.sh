#!/usr/bin/env bash
# On a GPU machine with two or more GPUs (device `run`, .device-carry carried):
# the carried attnserve serves on every GPU (--devices=all); `attnctl load
# --check` sends enough tokens to spill past one device's batch, every
# response is checked against the float64 reference, and the report must
# show requests on every device; then SIGTERM with load running must drain
# and exit 0. A short table is printed last.
# Shape and flag lists ($args, $shape, $C) are split into words on purpose.
# shellcheck disable=SC2086
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/gpu-multi-check-out}
mkdir -p "$OUT"
bin=.device-carry/bin
use_carried_libs lib
# The GPUs the server sees: CUDA_VISIBLE_DEVICES's list when set, else all.
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  ngpu=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
else
  ngpu=$(nvidia-smi -L | grep -c '^GPU')
fi
port=50931
C="$bin/attnctl --target=127.0.0.1:$port --timeout=60s"
# Goes on after a timeout: the checks below then fail and say so.
start_server "$OUT/server.log" 30 $C -- \
  "$bin/attnserve" --backend=cuda --devices=all --host=127.0.0.1 --port=$port --metrics_port=0 --http_port=0
spid=$SERVER_PID
$C info >"$OUT/info.txt" 2>&1
shape="--batch=4 --seqlen_q=512 --heads_q=8 --heads_kv=2 --head_dim=64 --dtype=fp16 --causal"
$C load --concurrency=32 --warmup=0s --duration=3s --channels=4 --check $shape >"$OUT/check.log" 2>&1
check_rc=$?
devices=$(grep -oE 'requests by device: .*' "$OUT/check.log" | sed 's/requests by device: //')
used=$(echo "$devices" | tr ';' '\n' | grep -c ':')
# A saturating load without --check (the check's float64 reference on the
# client would be the bottleneck): each device's share of the requests.
$C load --concurrency=64 --warmup=1s --duration=6s --channels=8 $shape >"$OUT/balance.log" 2>&1
balance=$(grep -oE 'requests by device: .*' "$OUT/balance.log" | sed 's/requests by device: //')
shares=$(echo "$balance" | tr ';' '\n' | awk -F: '{n[$1]=$2; t+=$2} END {for (d in n) printf "%s:%.1f%% ", d, 100*n[d]/t}')
# SIGTERM while a load runs: in-flight requests finish, the server exits 0.
$C load --concurrency=16 --warmup=0s --duration=4s $shape >"$OUT/drain-load.log" 2>&1 &
lpid=$!
sleep 2
kill -TERM $spid
wait $spid; server_rc=$?
wait $lpid
echo "==== gpu-multi-check ($ngpu GPUs)"
printf '%-28s %s\n' "devices listed by info" "$(grep -c '^device ' "$OUT/info.txt")"
printf '%-28s %s\n' "load --check rc" "$check_rc ($(grep -E '^concurrency=' "$OUT/check.log" | awk '{print $2" req/s, errors="$NF}'))"
printf '%-28s %s\n' "requests by device" "${devices:-none} (devices used: $used of $ngpu)"
printf '%-28s %s\n' "saturating load by device" "${balance:-none} (${shares:-no shares}; $(grep -E '^concurrency=' "$OUT/balance.log" | awk '{print $2" req/s"}'))"
printf '%-28s %s\n' "SIGTERM under load: exit" "$server_rc ($(grep -cE 'stopped after' "$OUT/server.log") 'stopped after' lines)"
[ "$check_rc" = 0 ] && [ "$used" = "$ngpu" ] && [ "$server_rc" = 0 ] && echo "RESULT: PASS" || echo "RESULT: FAIL"
