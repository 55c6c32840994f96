#!/usr/bin/env python3
"""The peers of bench/cuda/mask_bench on the same GPU, the same shapes and the
same block masks: PyTorch FlexAttention (compiled) with each block mask that
mask_bench wrote to --mask_dir, and PyTorch SDPA with an additive attn_mask
(the bias grid) on each backend that takes one, the fastest reported.

Timing as mask_bench: CUDA events, L2 flushed (256 MB memset) before every
run, 3 warm-ups, median of 15. CSV rows: peer,grid,pattern,mods,d,b,h,n,s,ms,note.
"""
import argparse
import csv
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F


def timed(fn, flush, warm=3, reps=15):
    times = []
    for it in range(warm + reps):
        flush.fill_(it & 0xFF)
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        if it >= warm:
            times.append(e0.elapsed_time(e1))
    times.sort()
    return times[len(times) // 2]


def block_mask_of(row_ptr, col_idx, b, heads, h, n, block=128):
    """A FlexAttention BlockMask with exactly the CSR's kept blocks (all full:
    every key of a kept block is attended, as in attnserve's block mask);
    the CSR's heads (1 or h) broadcast to h."""
    from torch.nn.attention.flex_attention import BlockMask

    rows = (n + block - 1) // block
    counts = np.diff(row_ptr).reshape(heads, rows)
    # Full width whatever the density: one compiled kernel per shape, not per mask.
    width = (n + block - 1) // block
    idx = np.zeros((heads, rows, width), dtype=np.int32)
    for r in range(heads * rows):
        cols = col_idx[row_ptr[r] : row_ptr[r + 1]]
        idx.reshape(heads * rows, width)[r, : len(cols)] = cols
    dev = "cuda"
    num = torch.from_numpy(counts.astype(np.int32)).to(dev)[None].expand(b, h, rows)
    ind = torch.from_numpy(idx).to(dev)[None].expand(b, h, rows, width)
    zeros = torch.zeros_like(num)
    return BlockMask.from_kv_blocks(
        zeros.contiguous(),
        ind.contiguous(),
        full_kv_num_blocks=num.contiguous(),
        full_kv_indices=ind.contiguous(),
        BLOCK_SIZE=block,
    )


def flex_rows(mask_dir, flush, writer):
    from torch.nn.attention.flex_attention import flex_attention

    # One compile per (shape, mask pattern); past dynamo's default of 8
    # recompiles flex_attention would fall back to its materialising eager path.
    torch._dynamo.config.cache_size_limit = 64
    flex = torch.compile(flex_attention, dynamic=False)
    with open(os.path.join(mask_dir, "index.csv")) as f:
        entries = list(csv.DictReader(f))
    dense_done = set()
    for e in entries:
        d, b, h, n = int(e["d"]), int(e["b"]), int(e["h"]), int(e["n"])
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        if (d, n) not in dense_done:
            dense_done.add((d, n))
            ms = timed(lambda: flex(q, k, v), flush)
            writer.writerow(["flex", "sparse", "dense", "none", d, b, h, n, 1.0, f"{ms:.4f}", "no block mask"])
        rp = np.fromfile(os.path.join(mask_dir, e["name"] + ".row_ptr.bin"), dtype=np.int32)
        ci = np.fromfile(os.path.join(mask_dir, e["name"] + ".col_idx.bin"), dtype=np.int32)
        heads = h if e["per_head"] == "1" else 1
        bm = block_mask_of(rp, ci, b, heads, h, n)
        try:
            ms = timed(lambda: flex(q, k, v, block_mask=bm), flush)
        except Exception as err:  # a row that cannot run is reported, the rest go on
            print(f"flex {e['name']}: failed: {type(err).__name__}: {err}"[:400], file=sys.stderr)
            torch.cuda.empty_cache()
            continue
        writer.writerow(["flex", "sparse", e["pattern"], "none", d, b, h, n, e["s"], f"{ms:.4f}", f"kept={e['kept']}"])
        print(f"flex {e['name']}: {ms:.3f} ms", file=sys.stderr)


def sdpa_bias_rows(flush, writer):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
    }
    for n in (1024, 2048, 4096, 8192):
        b, h, d = max(1, 16384 // n), 16, 128
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for mods, heads in (("none", 0), ("bias_shared", 1), ("bias_head", h)):
            mask = None if heads == 0 else torch.rand(1, heads, n, n, device="cuda", dtype=torch.bfloat16) * 4 - 2
            best, best_name = None, ""
            for name, be in backends.items():
                try:
                    with sdpa_kernel([be]):
                        ms = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), flush)
                except Exception:  # this backend does not take the input
                    continue
                writer.writerow(["sdpa_" + name, "bias", "dense", mods, d, b, h, n, 1.0, f"{ms:.4f}", ""])
                if best is None or ms < best:
                    best, best_name = ms, name
            if best is not None:
                writer.writerow(["sdpa_best", "bias", "dense", mods, d, b, h, n, 1.0, f"{best:.4f}", best_name])
            del mask
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mask_dir", help="mask_bench --mask_dir output (FlexAttention rows)")
    ap.add_argument("--csv", required=True, help="output CSV")
    ap.add_argument("--skip_bias", action="store_true", help="no SDPA attn_mask rows")
    args = ap.parse_args()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    with open(args.csv, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["peer", "grid", "pattern", "mods", "d", "b", "h", "n", "s", "ms", "note"])
        if args.mask_dir:
            flex_rows(args.mask_dir, flush, writer)
            f.flush()
        if not args.skip_bias:
            sdpa_bias_rows(flush, writer)


if __name__ == "__main__":
    main()
