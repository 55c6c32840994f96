#!/usr/bin/env bash
# On the GPU machine, after scripts/device/gpu-kv.sh has built BUILD (default
# build-gpu): Nsight Compute on one decode step at B = 16, Sk = 8k (Hq 32,
# Hkv 8, D 128, BF16) for our contiguous kernel, our paged kernel (pages of
# 16) and PyTorch SDPA's cuDNN kernel, same sections for all three, so the
# gap to cuDNN can be read off the same counters (duration, DRAM throughput,
# occupancy, stall reasons). Reports go to $OUT/ncu-decode-*.txt; a table of
# the headline counters is printed last.
# Usage: [BUILD=dir] [DECODE_B=16|1] bench/gpu/ncu_decode.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$PWD/ncu-decode-out}
mkdir -p "$OUT"
B=${BUILD:-build-gpu}
DECODE_B=${DECODE_B:-16}
case $DECODE_B in 1) skip=10 ;; 16) skip=40 ;; *) echo "DECODE_B must be 1 or 16" >&2; exit 2 ;; esac
sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy
  --section LaunchStats --section WarpStateStats --section SchedulerStats)
export LD_LIBRARY_PATH=$PWD/.device-carry/absl/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# attn_bench --grid=decode runs B=1 (Sk 8k) first, then B=16 (Sk 8k); each
# shape launches the timed kernel about 31 times (check, 5 warm-ups, 25 runs),
# so the 41st launch is one of B=16's timed runs and the 11th one of B=1's.
# On sm90 ours and paged16 are the Hopper decode kernel (else the portable
# ones); portable is the portable kernel everywhere.
for pair in AttnDecodeSm90Kernel:ours AttnFwdKernel:ours AttnFwdKernel:portable PagedAttnDecodeSm90Kernel:paged16 \
            PagedAttnFwdKernel:paged16; do
  k=${pair%%:*} impl=${pair#*:}
  [ -s "$OUT/ncu-decode-$impl-b$DECODE_B.txt" ] && grep -q 'Duration' "$OUT/ncu-decode-$impl-b$DECODE_B.txt" && continue
  timeout 150 ncu --clock-control none --kernel-name "regex:(^|:)$k(<|$)" --launch-skip $skip --launch-count 1 \
    "${sections[@]}" "$B/bench/cuda/attn_bench" --grid=decode --dtypes=bf16 --impls="$impl" --csv=/dev/null \
    >"$OUT/ncu-decode-$impl-b$DECODE_B.txt" 2>&1
done
# cuDNN: only the calls between cudaProfilerStart/Stop are profiled (the
# third one, after two warm-ups; a 256 MB write flushes L2 before each).
# Every kernel the call launches (up to 4): a split decode may add a reduction.
timeout 150 ncu --clock-control none --profile-from-start off --launch-skip 0 --launch-count 4 \
  "${sections[@]}" python3 - "$DECODE_B" >"$OUT/ncu-decode-cudnn-b$DECODE_B.txt" 2>&1 <<'EOF'
import sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
b = int(sys.argv[1])
q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
k = torch.randn(b, 8192, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
v = torch.randn(b, 8192, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    for i in range(3):
        flush.fill_(i)
        torch.cuda.synchronize()
        if i == 2:
            torch.cuda.cudart().cudaProfilerStart()
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
EOF
# Duration is summed over the kernels of the report (cuDNN may launch more than one).
total_us() { grep -E '^ +Duration ' "$1" | awk '{v=$NF; u=$(NF-1); f=(u=="ns"||u=="nsecond")?0.001:(u=="ms"||u=="msecond")?1000:1; t+=v*f} END{printf "%.2f us (%d kernels)", t, NR}'; }
printf '%-10s %s\n' impl "kernel | duration | DRAM throughput | achieved occupancy | registers/thread | grid"
for impl in ours paged16 portable cudnn; do
  f=$OUT/ncu-decode-$impl-b$DECODE_B.txt
  name=$(grep -E '^ +[A-Za-z_].*\(.*\)x\(.*\)' "$f" | head -1 | sed -E 's/^ +//' | cut -c1-60)
  get() { grep -E "^ +$1 " "$f" | head -1 | awk '{print $(NF-1), $NF}'; }
  printf '%-10s %s | %s | %s | %s | %s | %s\n' "$impl" "${name:-?}" "$(total_us "$f")" "$(get 'DRAM Throughput')" \
    "$(get 'Achieved Occupancy')" "$(get 'Registers Per Thread')" "$(get 'Grid Size')"
done
