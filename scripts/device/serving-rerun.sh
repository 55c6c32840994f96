#!/usr/bin/env bash
# On one GPU (device `run`, kind nvidia-h200; attnserve and attnctl built with
# CUDA and carried: scripts/device/pack-device-deps.sh --server BUILD_DIR, the
# commit in .device-carry/commit): issue 29's serving measurements again, in
# one call, every CSV with the GPU, versions and commit in '#' lines.
#   A  decode loop 64 x 8k, 1 layer (Hq 32 / Hkv 8 / D 128, BF16, pages of 64):
#      gRPC bytes, system shm and CUDA shm (load-kv --shm=none|system|cuda),
#      each unary and 4 streams, ROUNDS rounds alternated; first a short
#      --check loop over each; then Echo of one step's bytes at concurrency 1
#      (per-step overhead = unary p50 - kernel - Echo p50)
#   B  the in-process PyTorch loop (FLASH) at 1 layer
#   C  KServe v2 CUDA shm at the 256 MiB case (B 4, N 4096, H 16, D 128, FP16,
#      concurrency 1; cuda-shm-bench.sh's) against its bound (compute + the
#      copies the server still makes), system shm beside it; native CUDA shm:
#      `attnctl forward --shm=cuda` repeated at the same shape (server total
#      against the bound; the client's time includes its own copies into the
#      region); --verify through both; python/tests/test_shm.py (CUDA IPC
#      from torch) when .device-carry/wheels is carried
#   D  GPU tests when carried in .device-carry/bin: cuda_shm_test,
#      cuda_host_tensor_test
#   E  32 layers (65 GiB of pages, append-only prefill), 4 streams, bytes and
#      system shm, beside PyTorch FLASH and cuDNN (cuDNN's p50 per layer-step
#      is its steady time: 31 of every 32 layer-steps reuse the graph)
# Each part is guarded (a failure is printed and the next part runs) and is
# skipped when BUDGET_S would not cover it. $OUT gets at most 7 files:
# decode-loop-*.csv, echo-*.csv, cuda-shm-*.csv, tests.log, runs.log (every
# attnctl output and the servers' log tails), summary.txt (the table, printed
# last).
# Usage: [TOKENS=64] [ROUNDS=2] [BUDGET_S=450] scripts/device/serving-rerun.sh
#   BACKEND=cpu SERVE_BIN=build-cpu/server/attnserve CTL_BIN=build-cpu/client/attnctl SEQS=4 PROMPT=256 LARGE_N=256 LAYERS_E=2: a dry
#   run against a CPU server (no CUDA rows).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/serving-rerun-out}
mkdir -p "$OUT"
work=$(mktemp -d)
started=$SECONDS
budget=${BUDGET_S:-450}
tokens=${TOKENS:-64}
rounds=${ROUNDS:-2}
seqs=${SEQS:-64}
prompt=${PROMPT:-8192}
large_n=${LARGE_N:-4096}
layers_e=${LAYERS_E:-32}
backend=${BACKEND:-cuda}
bin=.device-carry/bin
if [ ! -x "$bin/attnserve" ] && [ -f .device-carry/server.tgz ]; then
  tar -C .device-carry -xzf .device-carry/server.tgz
fi
serve_bin=${SERVE_BIN:-$bin/attnserve}
ctl_bin=${CTL_BIN:-$bin/attnctl}
use_carried_libs lib
left() { echo $((budget - (SECONDS - started))); }
# cap N: N seconds, or what is left of the budget less 20 s if that is less (at least 10).
cap() { local c=$(($(left) - 20)); [ "$c" -lt "$1" ] || c=$1; [ "$c" -ge 10 ] || c=10; echo "$c"; }
step() { echo "== $* ($((SECONDS - started)) s)"; }
# log TITLE FILE: FILE appended to runs.log under a title.
log() { { echo "----- $1"; cat "$2" 2>/dev/null; } >>"$OUT/runs.log"; }

commit=$(head -1 .device-carry/commit 2>/dev/null || head -1 .device-carry/wheels/COMMIT 2>/dev/null ||
  git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ "$backend" = cuda ]; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  dev_flags=(--devices=0)
else
  gpu=cpu
  dev_flags=(--threads=2)
fi
slug=$(echo "${gpu:-unknown}" | tr '[:upper:]' '[:lower:]' | sed -E 's/nvidia //; s/[^a-z0-9]+/-/g; s/-+$//')
date_=$(date -u +%Y-%m-%d)
decode_csv=$OUT/decode-loop-$slug-$date_.csv
echo_csv=$OUT/echo-$slug-$date_.csv
shm_csv=$OUT/cuda-shm-$slug-$date_.csv
rm -f "$OUT"/*.csv "$OUT/tests.log" "$OUT/runs.log" "$OUT/summary.txt"
torch_v=$(timeout 60 python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null)
{
  echo "commit $commit; scripts/device/serving-rerun.sh at $(date -u +%FT%TZ); TOKENS=$tokens ROUNDS=$rounds backend $backend"
  nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader 2>/dev/null |
    sed 's/^/gpu: /'
  echo "$("$serve_bin" --version 2>&1 | head -1); ${torch_v:-no torch}; cpus $(nproc); server and client on one host (loopback)"
} | sed 's/^/# /' >"$work/header.txt"
cat "$work/header.txt"

pid=""
trap '[ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null; wait; rm -rf "$work"' EXIT
serve() {  # serve PORT NAME FLAGS...: a server on GPU 0, its log in $work/NAME.log; sets pid
  local port=$1 name=$2
  shift 2
  start_server "$work/$name.log" 90 "$ctl_bin" --target="127.0.0.1:$port" -- \
    "$serve_bin" --backend="$backend" "${dev_flags[@]}" --host=127.0.0.1 --port="$port" \
    --log_level=warn --metrics_port=0 --http_port=0 --allow_client_shm "$@" || {
    log "server $name (did not start)" "$work/$name.log"
    return 1
  }
  pid=$SERVER_PID
  "$ctl_bin" --target="127.0.0.1:$port" info 2>&1 | grep -E '^(version|backend|device)' | sed 's/^/# /' \
    >"$work/info.txt"
}
stop() {  # SIGTERM the server, KILL after 30 s; its log's tail into runs.log
  local name=$1
  [ -n "$pid" ] || return 0
  kill -TERM "$pid" 2>/dev/null
  wait_until 30 0.2 bash -c "! kill -0 $pid" || kill -KILL "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  pid=""
  tail -n 30 "$work/$name.log" >"$work/tail.txt"
  log "server $name (last 30 lines)" "$work/tail.txt"
}
kv_shape=(--heads_q=32 --heads_kv=8 --head_dim=128 --dtype=bf16 --page_size=64)
shms=(none system cuda)
[ "$backend" = cuda ] || shms=(none system)

# ---- A: the 1-layer decode loop, three transports, unary and 4 streams
part_a() {
  step "A: decode loop ${seqs} x ${prompt}, 1 layer"
  serve 50111 serverA --kv_cache_bytes=$((16 << 30)) || return 1
  local ctl=("$ctl_bin" --target=127.0.0.1:50111 --timeout=600s) shm cfg round label extra
  for shm in "${shms[@]}"; do
    timeout "$(cap 120)" "${ctl[@]}" load-kv --heads_q=32 --heads_kv=8 --head_dim=128 --dtype=bf16 --sequences=4 \
      --prompt=300 --tokens=3 --layers=2 --shm="$shm" --check >"$work/check.txt" 2>&1
    echo "load-kv --check --shm=$shm (4 x 300, 2 layers): rc=$? $(grep -iE 'check|mismatch' "$work/check.txt" | tail -1)" |
      tee -a "$OUT/tests.log"
    log "load-kv --check --shm=$shm" "$work/check.txt"
  done
  for round in $(seq 1 "$rounds"); do
    for shm in "${shms[@]}"; do
      for cfg in unary streams4; do
        label=$shm-$cfg-r$round
        [ "$(left)" -gt 140 ] || { echo "$label skipped: budget"; continue; }
        extra=(--concurrency=1)
        [ "$cfg" = streams4 ] && extra=(--concurrency=4 --stream --channels=4)
        echo "$label" >&2
        timeout "$(cap 150)" "${ctl[@]}" load-kv "${kv_shape[@]}" --sequences="$seqs" --prompt="$prompt" \
          --tokens="$tokens" --warmup_tokens=4 --layers=1 --prefill_attend=false "${extra[@]}" \
          --shm="$shm" --csv="$work/decode.csv" --label="$label" >"$work/run.txt" 2>&1 ||
          echo "$label failed: $(tail -2 "$work/run.txt")"
        log "load-kv $label" "$work/run.txt"
      done
    done
  done
  echo "echo64" >&2
  timeout "$(cap 60)" "${ctl[@]}" load --rpc=echo --batch="$seqs" --seqlen_q=1 --seqlen_k=1 --heads_q=32 \
    --heads_kv=8 --head_dim=128 --dtype=bf16 --concurrency=1 --warmup=2s --duration=6s \
    --csv="$work/echo.csv" --label=echo64 >"$work/run.txt" 2>&1 || echo "echo64 failed: $(tail -2 "$work/run.txt")"
  log "load --rpc=echo (one step's bytes)" "$work/run.txt"
  cp "$work/info.txt" "$work/info-decode.txt"
  stop serverA
}

# torch_local SDPA LAYERS STEPS: one in-process row appended to $work/torch.csv
torch_local() {
  [ "$backend" = cuda ] || return 0
  timeout "$(cap 150)" python3 bench/gpu/kv_torch_local.py --sdpa="$1" --sequences="$seqs" --context="$prompt" \
    --layers="$2" --steps="$3" >>"$work/torch.csv" 2>"$work/torch.err" ||
    echo "torch_local $1 $2 layers failed: $(tail -2 "$work/torch.err")"
  log "torch_local $1 layers=$2" "$work/torch.err"
}

# ---- C: CUDA shared memory, KServe v2 and native, against the bound
part_c() {
  step "C: KServe and native CUDA shm, B 4 x N $large_n, FP16"
  serve 50112 serverC || return 1
  local ctl=("$ctl_bin" --target=127.0.0.1:50112 --timeout=120s) proto i
  local large=(--batch=4 --seqlen_q="$large_n" --heads_q=16 --heads_kv=16 --head_dim=128 --dtype=fp16)
  local shm=cuda
  [ "$backend" = cuda ] || shm=system
  for proto in v2 native; do
    # A smaller shape than the timed one: the float64 reference of the large one is too slow.
    timeout "$(cap 120)" "${ctl[@]}" forward --protocol="$proto" --shm="$shm" --verify --seed=7 --batch=2 \
      --seqlen_q=1024 --heads_q=16 --heads_kv=16 --head_dim=128 --dtype=fp16 >"$work/verify.txt" 2>&1
    echo "forward --protocol=$proto --shm=$shm --verify (2 x 1024): rc=$? $(grep -E 'PASS|FAIL' "$work/verify.txt" | head -1)" |
      tee -a "$OUT/tests.log"
    log "forward --protocol=$proto --shm=$shm --verify" "$work/verify.txt"
  done
  local labels=(v2-shm-"$shm")
  [ "$shm" = cuda ] && labels+=(v2-shm-system)
  for label in "${labels[@]}"; do
    echo "$label" >&2
    timeout "$(cap 60)" "${ctl[@]}" load --warmup=2s --duration=6s --concurrency=1 --csv="$work/shm-rows.csv" \
      --label="$label" --protocol=v2 --shm="${label#v2-shm-}" "${large[@]}" >"$work/run.txt" 2>&1 ||
      echo "$label failed: $(tail -2 "$work/run.txt")"
    log "load $label" "$work/run.txt"
  done
  # Native CUDA shm: `load` has no native shm, so forward is repeated (the
  # first call dropped); each prints client and server times.
  : >"$work/native.txt"
  echo "$shm" >"$work/native-shm"
  for i in $(seq 0 "${NATIVE_REPS:-8}"); do
    [ "$(left)" -gt 60 ] || { echo "native forward: budget, stopped after $i calls"; break; }
    timeout "$(cap 60)" "${ctl[@]}" forward --protocol=native --shm="$shm" --seed=$((i + 1)) "${large[@]}" \
      >"$work/run.txt" 2>&1 || { echo "native forward $i failed: $(tail -2 "$work/run.txt")"; continue; }
    [ "$i" -gt 0 ] && grep -E '^latency:' "$work/run.txt" >>"$work/native.txt"
  done
  log "forward --protocol=native --shm=$shm, latency lines" "$work/native.txt"
  if [ -d .device-carry/wheels ] && [ "$backend" = cuda ]; then
    (
      use_carried_python "$PWD/.device-carry" python3 >"$work/pytest.txt" 2>&1 || exit 2
      ATTNSERVE_TARGET=127.0.0.1:50112 timeout "$(cap 150)" python3 -m pytest -q -p no:cacheprovider -rs \
        python/tests/test_shm.py >>"$work/pytest.txt" 2>&1
    )
    echo "python/tests/test_shm.py (CUDA IPC from torch): rc=$? $(tail -1 "$work/pytest.txt")" | tee -a "$OUT/tests.log"
    grep -E 'PASS|FAIL|SKIP|Error' "$work/pytest.txt" | head -20 >>"$OUT/tests.log"
    log "pytest test_shm.py" "$work/pytest.txt"
  else
    echo "python/tests/test_shm.py not run: no .device-carry/wheels (scripts/device/pack-python-carry.sh)" |
      tee -a "$OUT/tests.log"
  fi
  cp "$work/info.txt" "$work/info-shm.txt"
  stop serverC
}

# ---- D: the GPU tests of CUDA regions and page-locked host tensors, when carried
part_d() {
  step "D: GPU tests"
  local t
  for t in cuda_shm_test cuda_host_tensor_test; do
    if [ -x "$bin/$t" ]; then
      ATTNSERVE_BINARY=$PWD/$serve_bin timeout "$(cap 150)" "$bin/$t" >"$work/$t.log" 2>&1
      echo "$t: rc=$? $(gtest_counts "$work/$t.log")" | tee -a "$OUT/tests.log"
      grep -E '^\[  FAILED  \]|^\[       OK \]|^\[  SKIPPED \]' "$work/$t.log" >>"$OUT/tests.log"
    else
      echo "$t not run: not carried in $bin" | tee -a "$OUT/tests.log"
    fi
  done
}

# ---- E: 32 layers, 4 streams, bytes and system shm, beside FLASH and cuDNN
part_e() {
  step "E: decode loop ${seqs} x ${prompt}, $layers_e layers"
  serve 50113 serverE --kv_cache_bytes=$((80 << 30)) || return 1
  local ctl=("$ctl_bin" --target=127.0.0.1:50113 --timeout=600s) shm label
  for shm in none system; do
    label=$shm-streams4-${layers_e}layers
    [ "$(left)" -gt 60 ] || { echo "$label skipped: budget"; continue; }
    echo "$label" >&2
    timeout $(($(left) - 40)) "${ctl[@]}" load-kv "${kv_shape[@]}" --sequences="$seqs" --prompt="$prompt" \
      --tokens="${TOKENS_E:-16}" --warmup_tokens=2 --layers="$layers_e" --prefill_attend=false \
      --concurrency=4 --stream --channels=4 --shm="$shm" --csv="$work/decode.csv" --label="$label" \
      >"$work/run.txt" 2>&1 || echo "$label failed: $(tail -2 "$work/run.txt")"
    log "load-kv $label" "$work/run.txt"
  done
  stop serverE
  [ "$(left)" -gt 25 ] && torch_local flash "$layers_e" "${TOKENS_E:-16}"
  [ "$(left)" -gt 25 ] && torch_local cudnn "$layers_e" "${TOKENS_E:-16}"
}

part_a || echo "part A did not run to its end"
[ "$(left)" -gt 20 ] && torch_local flash 1 "$tokens"
if [ "$(left)" -gt 80 ]; then part_c || echo "part C did not run to its end"; else echo "part C skipped: budget"; fi
if [ "$(left)" -gt 60 ]; then part_d; else echo "part D skipped: budget"; fi
if [ "$(left)" -gt 130 ]; then part_e || echo "part E did not run to its end"; else echo "part E skipped: budget ($(left) s left)"; fi
step "tables"

# The CSVs: '#' lines (environment, commit, servers' info), then the rows.
python3 - "$work" "$decode_csv" "$echo_csv" "$shm_csv" "$OUT/summary.txt" "$tokens" "$seqs" <<'PY'
import csv, os, re, statistics, sys
work, decode_csv, echo_csv, shm_csv, summary, tokens, seqs = sys.argv[1:]
seqs = int(seqs)
header = open(os.path.join(work, "header.txt")).read()
def info(name):
    p = os.path.join(work, name)
    return open(p).read() if os.path.exists(p) else ""
def rows_of(path):
    if not os.path.exists(path):
        return [], []
    r = csv.DictReader(l for l in open(path) if not l.startswith("#"))
    rows = list(r)
    return (r.fieldnames or []), rows
def write(path, lines, fields, rows):
    if not rows:
        return
    with open(path, "w") as f:
        f.write(header + lines)
        w = csv.DictWriter(f, fieldnames=fields, lineterminator="\n", restval="", extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
f = lambda r, k: float(r[k]) if r.get(k) not in (None, "") else float("nan")

# Decode loop: load-kv rows, then torch_local rows (the same first 11 columns).
fields, dec = rows_of(os.path.join(work, "decode.csv"))
torch_fields = "scenario,impl,sequences,context,layers,page_size,tokens_per_s,tbps,p50_ms,p99_ms,label".split(",")
tp = os.path.join(work, "torch.csv")
tor = [dict(zip(torch_fields, l.strip().split(","))) for l in open(tp) if l.startswith("loop,")] if os.path.exists(tp) else []
write(decode_csv, info("info-decode.txt") + f"# TOKENS={tokens}, 4 warm-up tokens (1 layer); the rows of more layers: TOKENS_E (default 16), 2 warm-up, 4 streams; "
      "prefill append-only; p50/p99 per step (one call); torch_local rows: bench/gpu/kv_torch_local.py, p50/p99 per layer-step\n",
      fields or torch_fields, dec + tor)
efields, ech = rows_of(os.path.join(work, "echo.csv"))
write(echo_csv, info("info-decode.txt") + "# Echo of one decode step's bytes (q [S,1,32,128], k/v [S,1,8,128] BF16), concurrency 1, same server as the decode rows\n", efields, ech)

# CUDA shm: load rows with the bound, then the native forward rows.
sfields, shm = rows_of(os.path.join(work, "shm-rows.csv"))
for r in shm:
    bound = sum(f(r, k) for k in ("compute_ms", "host_to_device_ms", "device_to_host_ms"))
    r["bound_ms"] = f"{bound:.3f}"
    r["p50_over_bound"] = f"{f(r, 'p50_ms') / bound:.2f}" if bound > 0 else ""
pat = re.compile(r"client ([\d.]+) ms; server total ([\d.]+) ms \(queue ([\d.]+), host_to_device ([\d.]+), "
                 r"compute ([\d.]+), device_to_host ([\d.]+) ms")
nat = [tuple(map(float, m.groups())) for m in map(pat.search, open(os.path.join(work, "native.txt")))
       if m] if os.path.exists(os.path.join(work, "native.txt")) else []
if nat:
    col = lambda i: [n[i] for n in nat]
    med = lambda i: statistics.median(col(i))
    mean = lambda i: statistics.mean(col(i))
    bound = mean(3) + mean(4) + mean(5)
    shm.append({"label": "native-shm-forward", "mode": f"forward x{len(nat)}", "concurrency": "1",
                "dtype": "FP16", "batch": "4", "heads_q": "16", "heads_kv": "16", "head_dim": "128",
                "requests": str(len(nat)), "errors": "0", "p50_ms": f"{med(0):.3f}", "max_ms": f"{max(col(0)):.3f}",
                "mean_ms": f"{mean(0):.3f}", "queue_ms": f"{mean(2):.4f}", "host_to_device_ms": f"{mean(3):.4f}",
                "compute_ms": f"{mean(4):.4f}", "device_to_host_ms": f"{mean(5):.4f}", "protocol": "native",
                "shm": open(os.path.join(work, "native-shm")).read().strip(), "server_total_p50_ms": f"{med(1):.3f}",
                "bound_ms": f"{bound:.3f}", "p50_over_bound": f"{med(0) / bound:.2f}",
                "server_total_over_bound": f"{med(1) / bound:.2f}"})
sfields = (sfields or ["label", "mode", "concurrency", "p50_ms", "compute_ms", "protocol", "shm"]) + \
    ["server_total_p50_ms", "bound_ms", "p50_over_bound", "server_total_over_bound"]
write(shm_csv, info("info-shm.txt") + "# concurrency 1, 2 s warm-up + 6 s per load row; bound_ms = compute_ms + host_to_device_ms + "
      "device_to_host_ms (the server's means); native-shm-forward: `attnctl forward --shm` repeated (first call dropped), "
      "p50_ms is the client's (it includes the client's own cudaMemcpy of q/k/v into the region and O out), "
      "server_total_p50_ms the server's\n", sfields, shm)

# The summary: per configuration the median over rounds, and each target.
out = []
p = out.append
torch = {(r["layers"], r["label"]): f(r, "tokens_per_s") for r in tor}
torch_p50 = {(r["layers"], r["label"]): f(r, "p50_ms") for r in tor}
echo_p50 = f(ech[0], "p50_ms") if ech else float("nan")
groups = {}
for r in dec:
    groups.setdefault(re.sub(r"-r\d+$", "", r["label"]), []).append(r)
cols = ["tokens_per_s", "p50_ms", "p99_ms", "compute_ms", "host_to_device_ms", "device_to_host_ms",
        "queue_ms", "server_total_ms", "outside_server_p50_ms"]
p(f"{'config (median of rounds)':<26} {'n':>2} {'tok/s':>9} {'best':>9} {'p50':>7} {'p99':>7} {'kernel':>7} "
  f"{'h2d':>6} {'d2h':>6} {'queue':>6} {'server':>7} {'outside':>7} {'/FLASH':>7}")
med = {}
for g, rs in groups.items():
    m = {c: statistics.median(f(r, c) for r in rs) for c in cols}
    m["best"] = max(f(r, "tokens_per_s") for r in rs)
    m["layers"] = rs[0]["layers"]
    med[g] = m
    fl = torch.get((m["layers"], "sdpa_flash"), float("nan"))
    p(f"{g:<26} {len(rs):>2} {m['tokens_per_s']:>9.0f} {m['best']:>9.0f} {m['p50_ms']:>7.3f} {m['p99_ms']:>7.3f} "
      f"{m['compute_ms']:>7.3f} {m['host_to_device_ms']:>6.3f} {m['device_to_host_ms']:>6.3f} {m['queue_ms']:>6.3f} "
      f"{m['server_total_ms']:>7.3f} {m['outside_server_p50_ms']:>7.3f} {m['best'] / fl:>7.2f}")
for (layers, label), t in sorted(torch.items()):
    steady = ""
    if label == "sdpa_cudnn":
        steady = f"  (steady: {seqs / (int(layers) * torch_p50[(layers, label)] / 1000):.0f} tok/s from p50)"
    p(f"torch_local {label} {layers} layer(s): {t:.0f} tok/s, p50 {torch_p50[(layers, label)]:.3f} ms per layer-step{steady}")
p(f"Echo of one step's bytes, c 1: p50 {echo_p50:.3f} ms")
for r in shm:
    p(f"{r['label']:<22} p50 {f(r, 'p50_ms'):.3f} ms, kernel {f(r, 'compute_ms'):.3f}, copies "
      f"{f(r, 'host_to_device_ms') + f(r, 'device_to_host_ms'):.3f}, bound {r['bound_ms']}: p50/bound {r['p50_over_bound']}"
      + (f", server total/bound {r['server_total_over_bound']}" if r.get("server_total_over_bound") else ""))

def verdict(name, measured, target, better="ge", unit="x"):
    if measured != measured:
        p(f"{name:<46} not measured")
        return
    ok = measured >= target if better == "ge" else measured <= target
    p(f"{name:<46} {measured:8.3f}{unit} target {'>=' if better == 'ge' else '<='} {target}{unit}: "
      + ("met" if ok else f"MISSED by {abs(measured - target):.3f}{unit}"))
def best(prefix, layers="1"):
    v = [m["best"] for g, m in med.items() if g.startswith(prefix) and m["layers"] == layers]
    return max(v) if v else float("nan")
fl1 = torch.get(("1", "sdpa_flash"), float("nan"))
p("--- issue 29 targets")
verdict("T1a bytes best / FLASH (1 layer)", best("none-") / fl1, 1.0)
verdict("T1a shm best (system or cuda) / FLASH", max(best("system-"), best("cuda-")) / fl1, 1.0)
verdict("T1b shm unary best / FLASH", max(best("system-unary"), best("cuda-unary")) / fl1, 0.8)
le = [m for g, m in med.items() if m["layers"] != "1"]
if le:
    L = le[0]["layers"]
    bestL = max(m["best"] for m in le)
    verdict(f"T1c {L} layers best / FLASH", bestL / torch.get((L, "sdpa_flash"), float("nan")), 1.0)
    cp = torch_p50.get((L, "sdpa_cudnn"), float("nan"))
    verdict(f"T1c {L} layers best / cuDNN steady", bestL / (seqs / (int(L) * cp / 1000)), 1.0)
for g, name in (("none-unary", "T2a bytes unary: p50 - kernel - Echo p50"),):
    if g in med:
        verdict(name, (med[g]["p50_ms"] - med[g]["compute_ms"] - echo_p50) * 1000, 150, "le", " us")
for g in ("system-unary", "cuda-unary"):
    if g in med:
        verdict(f"T2b {g}: p50 - kernel", (med[g]["p50_ms"] - med[g]["compute_ms"]) * 1000, 150, "le", " us")
for r in shm:
    if r["label"].startswith("v2-shm-cuda"):
        verdict("T3 KServe CUDA shm p50 / bound", float(r["p50_over_bound"] or "nan"), 1.5, "le")
    if r["label"] == "native-shm-forward":
        verdict("T3 native shm forward: server total / bound", float(r["server_total_over_bound"]), 1.5, "le")
if "cuda-unary" in med:
    m = med["cuda-unary"]
    verdict("T3 native CUDA shm decode step p50 / bound", m["p50_ms"] / (m["compute_ms"] + m["host_to_device_ms"] + m["device_to_host_ms"]), 1.5, "le")
open(summary, "w").write("\n".join(out) + "\n")
PY
echo "--- tests and checks"
grep -vE '^\[       OK \]' "$OUT/tests.log" 2>/dev/null
echo "--- summary ($((SECONDS - started)) s in all; commit $commit)"
cat "$OUT/summary.txt" 2>/dev/null
ls "$OUT"
