#!/usr/bin/env python3
"""PyTorch SDPA on the MLA prefill shape (Q/K head dim 192, V/O 128:
DeepSeek-V3's), timed the way bench/cuda/mla_prefill_bench times ours: CUDA
events, L2 flushed (256 MB write) before each run, 5 warm-ups, median of 25,
random inputs, B x N = --tokens, K/V heads = query heads. Each SDPA backend
(cuDNN, FLASH, EFFICIENT) runs the shape as it is where it accepts a value
head dim differing from the query's (impl sdpa_<backend>); where it refuses,
the row says so on stderr and the backend runs instead with V zero-padded to
192 and O sliced back to 128 (impl sdpa_<backend>_padv: the padded V made
once, outside the timing), which is what a caller without Dv != Dqk support
does. Each backend's output is checked against the math backend's on the
first shape (relative L2 error < 2e-2). TFLOP/s counts the MLA shape's work,
2 x B x H x N x N x (Dqk + Dv), halved for causal, for every row. CSV rows:
kind,dtype,dqk,dv,b,hq,hkv,sq,sk,causal,impl,kernel,ms,tflops (kernel: the
torch and cuDNN versions)."""
import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def timed(run, flush):
    times = []
    for it in range(30):
        flush.fill_(it & 0xff)
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        run()
        e1.record()
        e1.synchronize()
        if it >= 5:
            times.append(e0.elapsed_time(e1))
    times.sort()
    return times[len(times) // 2]


def rel_err(x, ref):
    x, ref = x.float(), ref.float()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="1024,2048,4096,8192,16384")
    ap.add_argument("--hqs", default="128,16")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dqk", type=int, default=192)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--csv", default="-")
    a = ap.parse_args()
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    f = sys.stdout if a.csv == "-" else open(a.csv, "w")
    f.write("kind,dtype,dqk,dv,b,hq,hkv,sq,sk,causal,impl,kernel,ms,tflops\n")
    version = f"torch{torch.__version__}-cudnn{torch.backends.cudnn.version()}"
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    checked = set()
    for h in [int(x) for x in a.hqs.split(",")]:
        for n in [int(x) for x in a.ns.split(",")]:
            b = max(1, a.tokens // n)
            # Stored as the service stores them, [B, S, H, D]; SDPA takes [B, H, S, D] views.
            q = torch.randn(b, n, h, a.dqk, device="cuda", dtype=dt).transpose(1, 2)
            k = torch.randn(b, n, h, a.dqk, device="cuda", dtype=dt).transpose(1, 2)
            v = torch.randn(b, n, h, a.dv, device="cuda", dtype=dt).transpose(1, 2)
            vpad = F.pad(v, (0, a.dqk - a.dv)) if a.dqk > a.dv else v
            for c in [int(x) for x in a.causal.split(",")]:
                flops = 2.0 * b * h * n * n * (a.dqk + a.dv) / (2 if c else 1)
                ref = None
                for name, be in BACKENDS.items():
                    for impl, vv in ((f"sdpa_{name}", v), (f"sdpa_{name}_padv", vpad)):
                        try:
                            with sdpa_kernel([be]):
                                run = lambda: F.scaled_dot_product_attention(
                                    q, k, vv, is_causal=bool(c), scale=a.dqk ** -0.5)
                                out = run()[..., :a.dv]
                                torch.cuda.synchronize()
                                if (impl, c) not in checked:
                                    # One sequence, 4 heads: the math backend's memory.
                                    sl = (slice(0, 1), slice(0, 4))
                                    if ref is None:
                                        with sdpa_kernel([SDPBackend.MATH]):
                                            ref = F.scaled_dot_product_attention(
                                                q[sl].float(), k[sl].float(), v[sl].float(),
                                                is_causal=bool(c), scale=a.dqk ** -0.5)
                                    err = rel_err(out[sl], ref)
                                    if err > 2e-2:
                                        raise RuntimeError(f"rel L2 err {err:.2e} against math")
                                    checked.add((impl, c))
                                del out
                                ms = timed(run, flush)
                        except RuntimeError as e:
                            print(f"skip {impl} h={h} n={n} causal={c}: "
                                  f"{str(e).splitlines()[0][:160]}", file=sys.stderr)
                            continue
                        f.write(f"prefill,{a.dtype},{a.dqk},{a.dv},{b},{h},{h},{n},{n},{c},{impl},"
                                f"{version},{ms:.4f},{flops / (ms * 1e-3) * 1e-12:.2f}\n")
                        f.flush()
                        break  # the backend took V as it is: no padded row
                ref = None
            del q, k, v, vpad
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
