#!/usr/bin/env bash
# On the GPU machine (device `run`; a CUDA server and attnctl carried with
# scripts/device/pack-device-deps.sh --server BUILD_DIR, then tar -czf
# .device-carry/server.tgz of bin/ and lib/): the K/V decode loop over
# gRPC bytes against the same loop over same-host POSIX shared memory
# (attnctl load-kv --shm=system), each unary (one group) and with 4 streams,
# rounds alternated, beside the in-process PyTorch loop (FLASH) on the same
# GPU. Shape: 64 sequences x 8k context, Hq 32 / Hkv 8 / D 128, BF16, pages of
# 64, one layer. Rows go to $OUT/kv-shm-decode.csv (load-kv's columns plus
# transport); a table is printed last.
# Usage: [TOKENS=48] [ROUNDS=2] scripts/device/kv-shm-decode.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/kv-shm-decode-out}
mkdir -p "$OUT"
[ -f .device-carry/server.tgz ] && tar -C .device-carry -xzf .device-carry/server.tgz
use_carried_libs lib
bin=.device-carry/bin
csv=$OUT/kv-shm-decode.csv
rm -f "$csv"
{
  nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv
  echo "commit ${ATTNSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
} | sed 's/^/# /' >"$OUT/header.txt"
port=50073
ctl=("$bin/attnctl" --target="127.0.0.1:$port" --timeout=600s)
start_server "$OUT/server.log" 90 "${ctl[@]}" -- "$bin/attnserve" --backend=cuda --host=127.0.0.1 \
  --port="$port" --log_level=warn --metrics_port=0 --http_port=0 --devices=0 \
  --kv_cache_bytes=$((16 << 30)) --allow_client_shm || exit 1
pid=$SERVER_PID
trap 'kill -TERM "$pid" 2>/dev/null; wait' EXIT
shape=(--heads_q=32 --heads_kv=8 --head_dim=128 --dtype=bf16 --page_size=64 --sequences=64
  --prompt=8192 --tokens="${TOKENS:-48}" --warmup_tokens=4 --layers=1 --prefill_attend=false)
# One short checked loop over shared memory first: the outputs are right.
if "${ctl[@]}" load-kv --heads_q=32 --heads_kv=8 --head_dim=128 --dtype=bf16 --sequences=4 \
  --prompt=300 --tokens=3 --shm=system --check >"$OUT/check.txt" 2>&1; then
  echo "shm --check: ok"
else
  echo "shm --check FAILED"
  tail -5 "$OUT/check.txt"
fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  for shm in none system; do
    for cfg in unary streams4; do
      extra=(--concurrency=1)
      [ "$cfg" = streams4 ] && extra=(--concurrency=4 --stream --channels=4)
      label="$shm-$cfg-r$round"
      echo "round $round: $label" >&2
      timeout 240 "${ctl[@]}" load-kv "${shape[@]}" "${extra[@]}" --shm="$shm" --csv="$csv" \
        --label="$label" >"$OUT/$label.txt" 2>&1 || echo "$label failed: $(tail -2 "$OUT/$label.txt")"
    done
  done
done
kill -TERM "$pid"
wait "$pid" 2>/dev/null
# The in-process loop on the same GPU (FLASH: cuDNN rebuilds its graph for
# every new length at one layer).
timeout 180 python3 bench/gpu/kv_torch_local.py --sequences=64 --context=8192 --steps="${TOKENS:-48}" \
  --layers=1 --sdpa=flash --header >"$OUT/torch-local.csv" 2>"$OUT/torch-local.err" ||
  echo "torch_local failed: $(tail -2 "$OUT/torch-local.err")"
python3 - "$csv" "$OUT/torch-local.csv" <<'EOF'
import csv, os, sys
rows = list(csv.DictReader(open(sys.argv[1])))
cols = ["label", "tokens_per_s", "p50_ms", "p99_ms", "compute_ms", "server_total_ms",
        "outside_server_p50_ms", "host_to_device_ms", "device_to_host_ms"]
print(" ".join(f"{c[:14]:>14}" for c in cols))
for r in rows:
    print(" ".join(f"{r.get(c, '')[:14]:>14}" for c in cols))
if os.path.exists(sys.argv[2]):
    for r in csv.DictReader(l for l in open(sys.argv[2]) if l.startswith(("scenario", "loop"))):
        print(f"{'torch_local ' + r['label']:>14} {r['tokens_per_s']:>14} {r['p50_ms']:>14} {r['p99_ms']:>14}")
EOF
