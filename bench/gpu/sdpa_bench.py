#!/usr/bin/env python3
"""Times PyTorch scaled_dot_product_attention (FLASH, CUDNN, EFFICIENT) on
docs/design.md §5's anchor and decode grids, the same way attn_bench times ours:
CUDA events, L2 flushed (256 MB write) before each run, 5 warm-ups, median of
25 runs, random inputs. Writes CSV rows in the §5 format (impl = sdpa_flash,
sdpa_cudnn, sdpa_efficient); a backend that refuses a shape is skipped.
--kv_csv=FILE also writes the decode rows of FLASH and CUDNN in the K/V
benchmark's format (as attn_bench --kv_csv), timed over 100 runs."""
import argparse
import math
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}


def shapes(grid, dtypes):
    out = []
    for dn in dtypes:
        if grid in ("anchor", "all", "quick"):
            for d in (64, 128, 256):
                for n in (512, 1024, 2048, 4096, 8192, 16384):
                    if grid == "quick" and n not in (1024, 8192):
                        continue
                    for c in (False, True):
                        out.append(("prefill", dn, d, 16384 // n, 2048 // d, 2048 // d, n, n, c))
        if grid == "hdims":
            for d in (32, 96, 192):
                for n in (1024, 8192):
                    for c in (False, True):
                        out.append(("prefill", dn, d, 16384 // n, 2048 // d, 2048 // d, n, n, c))
        if grid == "decodesweep":
            for b in (1, 16):
                for sk in (1024, 2048, 4096, 8192, 16384, 32768):
                    out.append(("decode", dn, 128, b, 32, 8, 1, sk, False))
            for sk in (8192, 32768):
                out.append(("prefill", dn, 128, 1, 32, 8, 128, sk, False))
        if grid in ("decode", "all", "quick"):
            for b, sk in ((1, 8192), (16, 8192), (64, 4096), (8, 65536)):
                out.append(("decode", dn, 128, b, 32, 8, 1, sk, False))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", default="all")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--csv", default="-")
    ap.add_argument("--kv_csv", default="")
    a = ap.parse_args()
    kv = open(a.kv_csv, "w") if a.kv_csv else None
    f = sys.stdout if a.csv == "-" else open(a.csv, "w")
    f.write("kind,dtype,d,b,hq,hkv,sq,sk,causal,impl,ms,tflops,tbps,peak_mem_bytes\n")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for kind, dn, d, b, hq, hkv, sq, sk, causal in shapes(a.grid, a.dtypes.split(",")):
        dt = torch.bfloat16 if dn == "bf16" else torch.float16
        # Stored as the service stores them, [B, S, H, D]; SDPA takes [B, H, S, D] views.
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=dt).transpose(1, 2)
        k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dt).transpose(1, 2)
        v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dt).transpose(1, 2)
        for name, be in BACKENDS.items():
            try:
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                with sdpa_kernel([be]):
                    run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != hq)
                    ref = run()
                    torch.cuda.synchronize()
                    times = []
                    runs = 105 if kv and kind == "decode" else 30
                    for it in range(runs):
                        flush.fill_(it & 0xff)
                        e0 = torch.cuda.Event(enable_timing=True)
                        e1 = torch.cuda.Event(enable_timing=True)
                        e0.record()
                        run()
                        e1.record()
                        e1.synchronize()
                        if it >= 5:
                            times.append(e0.elapsed_time(e1))
                peak = torch.cuda.max_memory_allocated() - base + 2 * (q.numel() + 2 * k.numel()) + 2 * q.numel()
                del ref
            except RuntimeError as e:
                print(f"skip {name} {kind} d={d} n={sk} causal={causal}: {str(e).splitlines()[0][:100]}",
                      file=sys.stderr)
                continue
            times.sort()
            ms = times[len(times) // 2]
            flops = 4.0 * b * hq * sq * sk * d / (2 if causal and sq == sk else 1)
            nbytes = 2.0 * 2 * k.numel() if kind == "decode" else 2.0 * (2 * q.numel() + 2 * k.numel())
            f.write(f"{kind},{dn},{d},{b},{hq},{hkv},{sq},{sk},{int(causal)},{name},{ms:.4f},"
                    f"{flops / ms * 1e-9:.2f},{nbytes / ms * 1e-9:.3f},{peak}\n")
            f.flush()
            if kv and kind == "decode" and name in ("sdpa_cudnn", "sdpa_flash"):
                p99 = times[min(len(times) - 1, math.ceil(0.99 * len(times)) - 1)]
                kv.write(f"kernel,{name},{b},{sk},1,,{b / (ms * 1e-3):.0f},{nbytes / ms * 1e-9:.3f},"
                         f"{ms:.4f},{p99:.4f}\n")
                kv.flush()
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
