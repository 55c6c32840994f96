#!/usr/bin/env bash
# On the GPU machine: checks and measures the python_sdpa baseline server.
#  1. the server's end-to-end tests on GPU 0;
#  2. starts sdpa_server.py on GPU 0 and runs `attnctl forward --verify` on a set
#     of shapes (GQA, causal with Sq != Sk, windows, varlen, all dtypes);
#  3. `attnctl load --check` briefly, unary and ForwardStream;
#  4. the serving benchmark's two scenarios (scripts/device/gpu-serving.sh's shapes and
#     flags, label python_sdpa): small B=1 Sq=Sk=256 Hq=16 D=128 BF16 at
#     concurrency 1,16,64 (with --check), large B=4 Sq=Sk=4096 at 1,4 (no check:
#     its float64 reference takes minutes on the CPU), small again without --check
#     (the client's per-response check limits concurrency 1), and small over the
#     Echo RPC (this server's transport ceiling); rows to $OUT/baseline.csv.
# Usage: bench/baselines/gpu_check.sh [SECONDS_PER_STEP]   (default 5)
#   DEVICE=cpu SCENARIOS=0 runs steps 1-3 on the CPU (tries the script without a GPU).
#   ATTNCTL=path/to/attnctl (default .device-carry/bin/attnctl, else
#   build-baseline-static/client/attnctl: a static build carried over)
set -uo pipefail
cd "$(dirname "$0")/../.."
# The generated message classes: the attnserve wheel and a matching protobuf
# (and grpcio-health-checking) carried as wheels in $WHEELS (README.md).
WHEELS=${WHEELS:-.device-carry/wheels}
if [[ -d $WHEELS ]]; then
  pylib=$PWD/.pylib
  ${PYTHON:-python3} -m pip install -q --no-deps --no-index --target "$pylib" "$WHEELS"/*.whl || exit 2
  export PYTHONPATH=$pylib${PYTHONPATH:+:$PYTHONPATH}
fi
OUT=${OUT:-$PWD/baseline-out}
mkdir -p "$OUT"
secs=${1:-5}
port=50071
dev=${DEVICE:-0}
py=${PYTHON:-python3}
ctl=${ATTNCTL:-}
if [[ -z $ctl ]]; then
  for c in .device-carry/bin/attnctl build-baseline-static/client/attnctl; do
    [[ -x $c ]] && ctl=$c && break
  done
fi
[[ -x $ctl ]] || { echo "no attnctl (set ATTNCTL)"; exit 2; }
A=("$ctl" --target="127.0.0.1:$port" --timeout=120s)
export PYTHONUNBUFFERED=1
fail=0

[[ $dev == cpu ]] || nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/gpu.txt"
$py -c 'import sys, torch, grpc, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "grpcio", grpc.__version__, "numpy", numpy.__version__, "cuda", torch.cuda.is_available())'

echo "== unit tests"
$py -c 'import google.protobuf, attnserve.v1.attention_pb2; print("protobuf", google.protobuf.__version__)' || exit 2
SDPA_TEST_DEVICE=$dev $py -W ignore bench/baselines/test_sdpa_server.py -v 2>&1 | tail -15
[[ ${PIPESTATUS[0]} == 0 ]] || fail=1

echo "== server"
$py bench/baselines/sdpa_server.py --port=$port --device=$dev >"$OUT/server.log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid' EXIT
ok=
for _ in $(seq 1 150); do
  "${A[@]}" health >/dev/null 2>&1 && ok=1 && break
  sleep 0.2
done
[[ -n $ok ]] || { echo "server did not become SERVING"; cat "$OUT/server.log"; exit 1; }
"${A[@]}" info

echo "== forward --verify"
while read -r shape; do
  [[ -z $shape ]] && continue
  line=$("${A[@]}" forward $shape --verify 2>&1)
  rc=$?
  echo "$(echo "$line" | tail -1) [rc=$rc] $shape"
  [[ $rc == 0 ]] || { fail=1; echo "$line" | tail -4; }
done <<'EOF'
--batch=2 --seqlen_q=256 --heads_q=16 --head_dim=128 --dtype=bf16 --causal
--batch=2 --seqlen_q=97 --heads_q=16 --heads_kv=4 --head_dim=128 --dtype=bf16 --causal
--batch=1 --seqlen_q=17 --seqlen_k=1025 --heads_q=8 --heads_kv=1 --head_dim=64 --dtype=fp16 --causal
--batch=2 --seqlen_q=100 --seqlen_k=17 --heads_q=8 --heads_kv=2 --head_dim=64 --dtype=bf16 --causal
--batch=2 --seqlen_q=100 --seqlen_k=17 --heads_q=8 --heads_kv=2 --head_dim=32 --dtype=fp32 --causal
--batch=2 --seqlen_q=200 --seqlen_k=70 --heads_q=4 --head_dim=64 --dtype=fp32 --causal
--batch=2 --seqlen_q=70 --seqlen_k=200 --heads_q=4 --head_dim=64 --dtype=fp32 --causal
--batch=4 --seqlen_q=1 --seqlen_k=4096 --heads_q=32 --heads_kv=8 --head_dim=128 --dtype=bf16 --causal
--batch=2 --seqlen_q=64 --seqlen_k=80 --heads_q=4 --head_dim=256 --dtype=fp16 --window_left=10 --window_right=3
--batch=1 --seqlen_q=80 --seqlen_k=50 --heads_q=4 --heads_kv=2 --head_dim=8 --dtype=bf16 --causal --window_left=5
--batch=1 --seqlen_q=300 --heads_q=8 --head_dim=96 --dtype=fp32 --softmax_scale=0.05
--varlen_q=3,0,17,200 --varlen_k=5,0,40,180 --heads_q=8 --heads_kv=2 --head_dim=128 --dtype=bf16 --causal
--varlen_q=3,0,17,9 --varlen_k=5,4,40,0 --heads_q=8 --heads_kv=2 --head_dim=64 --dtype=fp16 --window_left=4
EOF

echo "== load --check (unary, stream)"
chk="--batch=2 --seqlen_q=77 --seqlen_k=200 --heads_q=16 --heads_kv=4 --head_dim=128 --dtype=bf16 --causal"
"${A[@]}" load --concurrency=4 --warmup=1s --duration=3s --check $chk 2>/dev/null | grep -E "^(concurrency|  |FAIL)" || fail=1
"${A[@]}" load --concurrency=4 --stream --channels=2 --warmup=1s --duration=3s --check $chk 2>/dev/null | grep -E "^(concurrency|  |FAIL)" || fail=1

if [[ ${SCENARIOS:-1} == 0 ]]; then
  echo "gpu_check: $([[ $fail == 0 ]] && echo PASS || echo FAIL) (scenarios skipped)"
  exit $fail
fi
echo "== serving scenarios (gpu-serving.sh's shapes)"
small="--batch=1 --seqlen_q=256 --heads_q=16 --head_dim=128 --dtype=bf16"
large="--batch=4 --seqlen_q=4096 --heads_q=16 --head_dim=128 --dtype=bf16"
csv=$OUT/baseline.csv
rm -f "$csv"
run() {  # run LABEL CONCURRENCY CHECK SHAPE...
  local label=$1 conc=$2 check=$3; shift 3
  "${A[@]}" load --concurrency="$conc" --warmup=1s --duration="${secs}s" --channels=4 $check \
    --label="$label" --csv="$csv" "$@" >>"$OUT/load.log" 2>>"$OUT/load-progress.log"
  local rc=$?
  echo "$label c=$conc rc=$rc"
  [[ $rc == 0 ]] || fail=1
}
run small/python_sdpa 1,16,64 --check $small
run large/python_sdpa 1,4 "" $large
run small/python_sdpa/nocheck 1,16,64 "" $small
"${A[@]}" load --rpc=echo --concurrency=1,16,64 --warmup=1s --duration=3s --channels=4 \
  --label=small/python_sdpa/echo --csv="$csv" $small >>"$OUT/load.log" 2>/dev/null
grep -E '^(load:|concurrency=|  errors|  first)' "$OUT/load.log"
echo "---- server log (tail)"
tail -5 "$OUT/server.log"
echo "gpu_check: $([[ $fail == 0 ]] && echo PASS || echo FAIL)"
exit $fail
