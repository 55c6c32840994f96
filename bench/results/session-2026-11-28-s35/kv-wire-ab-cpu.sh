#!/bin/bash
# ab.sh ROUNDS OUTDIR SPEC... ; SPEC = NAME=SERVERDIR,CLIENTDIR (each with bin/attnserve, bin/attnctl)
# The GPU loop's bytes per step (64 sequences, Hq 32 / Hkv 8 / D 128, BF16: q 512 KiB, k/v 128 KiB
# each in, o 512 KiB out) on the CPU backend, unary, concurrency 1, rounds alternated; Echo of
# the same bytes beside each run; the client's CPU time (perf stat task-clock) per run.
rounds=$1; out=$2; shift 2
mkdir -p "$out"
heads=(--heads_q=32 --heads_kv=8 --head_dim=128 --dtype=bf16)
kv=("${heads[@]}" --page_size=16 --sequences=64 --prompt=0 --tokens=${TOKENS:-5} --warmup_tokens=1 --layers=${LAYERS:-80} --prefill_attend=false)
port=50400
for r in $(seq 1 "$rounds"); do
  for spec in "$@"; do
    name=${spec%%=*}; dirs=${spec#*=}; sdir=${dirs%%,*}; cdir=${dirs#*,}
    port=$(python3 -c "import socket; s=socket.socket(); s.bind((\"127.0.0.1\", 0)); print(s.getsockname()[1])")
    log=$out/$name-r$r
    "$sdir/bin/attnserve" --backend=cpu --host=127.0.0.1 --port=$port --log_level=warn --metrics_port=0 \
      --http_port=0 --kv_cache_bytes=$((1 << 30)) >"$log-server.log" 2>&1 &
    sp=$!
    for i in $(seq 100); do "$cdir/bin/attnctl" --target=127.0.0.1:$port --timeout=2s health >/dev/null 2>&1 && break; sleep 0.1; done
    ctl=("$cdir/bin/attnctl" --target=127.0.0.1:$port --timeout=120s)
    perf stat -x, -e task-clock -o "$log-kv.stat" "${ctl[@]}" load-kv "${kv[@]}" ${KV_EXTRA:-} >"$log-kv.txt" 2>&1
    "${ctl[@]}" load --rpc=echo --batch=64 --seqlen_q=1 --seqlen_k=1 "${heads[@]}" --concurrency=1 \
      --warmup=1s --duration=${ECHO_S:-3}s --csv="$log-echo.csv" --label=echo >"$log-echo.txt" 2>&1
    kill -TERM $sp; wait $sp 2>/dev/null
    python3 - "$name" "$r" "$log" <<'PY' | tee -a "$out/rows.txt"
import csv, re, sys
name, r, log = sys.argv[1:]
t = open(log + "-kv.txt").read()
def g(p):
    m = re.search(p, t); return float(m.group(1)) if m else float("nan")
p50 = g(r"p50 ([0-9.]+) ms"); q = g(r"queue ([0-9.]+) ms"); comp = g(r"compute ([0-9.]+) ms")
tot = g(r"total ([0-9.]+) ms"); outside = g(r"outside the server: p50 ([0-9.]+) ms")
steps = g(r"\(([0-9]+) layer-steps\)")
try: echo = float(next(csv.DictReader(open(log + "-echo.csv")))["p50_ms"])
except Exception: echo = float("nan")
cpu = float("nan")
for line in open(log + "-kv.stat"):
    if "task-clock" in line: cpu = float(line.split(",")[0])  # ms
print(f"{name:10s} r{r} p50 {p50*1e3:7.0f} us compute {comp*1e3:6.0f} server-noncompute {(tot-comp-q)*1e3:5.0f} queue {q*1e3:4.0f} "
      f"outside {outside*1e3:5.0f} echo {echo*1e3:5.0f} outside-echo {(outside-echo)*1e3:5.0f} "
      f"p50-compute-echo {(p50-comp-echo)*1e3:6.0f} client-cpu/step {cpu*1e3/steps if steps==steps else 0:5.0f} us")
PY
  done
done
