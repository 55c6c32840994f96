#!/usr/bin/env python3
"""The local ceiling of the K/V service's decode step: an in-process PyTorch
decode loop doing what attnserve's K/V decode loop does, on the same GPU, with
no network: per layer-step, append one new K/V token per sequence into a
contiguous preallocated cache and attend one query token per sequence over the
whole context with SDPA (cuDNN, then FLASH, then the default), GQA by
expanding nothing (enable_gqa). Prints one CSV row per configuration with the
columns of bench/results/kv-*.csv (scenario=loop, impl=torch_local).

Tokens/s counts generated tokens: sequences x steps / time, where one step is
one new token through every layer. p50/p99 are per layer-step (one append and
one attention call for all sequences), timed with CUDA events.

  python3 bench/gpu/kv_torch_local.py --sequences 64 --context 8192 --layers 1,32
"""
import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def pick_backend(q, k, v, wanted):
    """The first SDPA backend of `wanted` that runs this shape. cuDNN is the
    fastest decode kernel on Hopper, but it builds a graph for every new
    sequence length it sees (tens of ms): a loop whose context grows by one
    token per step pays that at every step unless many layers share the shape,
    so both are measured."""
    for be in wanted:
        try:
            with sdpa_kernel([be]):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            torch.cuda.synchronize()
            return be
        except RuntimeError:
            continue
    raise SystemExit("no SDPA backend runs this shape")


def run(sequences, context, layers, hq, hkv, d, steps, dtype, wanted):
    dev = torch.device("cuda")
    # [L, B, Hkv, S_max, D]: a context prefix of random values, room for the
    # generated tokens after it.
    s_max = context + steps + 1
    k_cache = torch.randn(layers, sequences, hkv, s_max, d, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(sequences, hq, 1, d, device=dev, dtype=dtype)
    k_new = torch.randn(sequences, hkv, 1, d, device=dev, dtype=dtype)
    v_new = torch.randn_like(k_new)
    be = pick_backend(q, k_cache[0, :, :, :context], v_cache[0, :, :, :context], wanted)
    times = []
    start_evt = [torch.cuda.Event(enable_timing=True) for _ in range(steps * layers)]
    end_evt = [torch.cuda.Event(enable_timing=True) for _ in range(steps * layers)]
    torch.cuda.synchronize()
    wall0 = time.perf_counter()
    with sdpa_kernel([be]):
        i = 0
        for step in range(steps):
            pos = context + step
            for layer in range(layers):
                start_evt[i].record()
                k_cache[layer, :, :, pos : pos + 1].copy_(k_new)
                v_cache[layer, :, :, pos : pos + 1].copy_(v_new)
                out = F.scaled_dot_product_attention(
                    q, k_cache[layer, :, :, : pos + 1], v_cache[layer, :, :, : pos + 1], enable_gqa=True
                )
                end_evt[i].record()
                i += 1
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall0
    del out
    times = sorted(s.elapsed_time(e) for s, e in zip(start_evt, end_evt))
    p = lambda f: times[min(len(times) - 1, int(f * len(times)))]
    tokens_per_s = sequences * steps / wall
    kv_bytes = 2 * sequences * hkv * (context + steps / 2) * d * k_cache.element_size() * layers * steps
    return {
        "tokens_per_s": tokens_per_s,
        "tbps": kv_bytes / wall / 1e12,
        "p50_ms": p(0.5),
        "p99_ms": p(0.99),
        "backend": be.name,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layers", default="1,32", help="comma-separated layer counts")
    ap.add_argument("--heads_q", type=int, default=32)
    ap.add_argument("--heads_kv", type=int, default=8)
    ap.add_argument("--head_dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32, help="generated tokens per sequence (after 4 warm-up steps)")
    ap.add_argument("--sdpa", default="cudnn,flash,efficient",
                    help="SDPA backends to try in order (cudnn, flash, efficient); the first that runs is used")
    ap.add_argument("--header", action="store_true", help="print the CSV header first")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("kv_torch_local: no CUDA device", file=sys.stderr)
        return 2
    if a.header:
        print("scenario,impl,sequences,context,layers,page_size,tokens_per_s,tbps,p50_ms,p99_ms,label")
    wanted = [BACKENDS[x] for x in a.sdpa.split(",")]
    for layers in (int(x) for x in a.layers.split(",")):
        shape = (a.sequences, a.context, layers, a.heads_q, a.heads_kv, a.head_dim)
        run(*shape, 4, torch.bfloat16, wanted)  # warm-up
        r = run(*shape, a.steps, torch.bfloat16, wanted)
        print(
            f"loop,torch_local,{a.sequences},{a.context},{layers},0,{r['tokens_per_s']:.1f},"
            f"{r['tbps']:.3f},{r['p50_ms']:.4f},{r['p99_ms']:.4f},sdpa_{r['backend'].split('_')[0].lower()}"
        )
        print(f"# torch_local layers={layers}: SDPA backend {r['backend']}", file=sys.stderr)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
