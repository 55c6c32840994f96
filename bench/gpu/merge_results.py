#!/usr/bin/env python3
"""Merges attn_bench and sdpa_bench CSVs into bench/results/<gpu>-<date>.csv
(docs/design.md §5: '#' header lines with GPU, clocks, versions, then rows) and
prints ours against the best of FLASH/CUDNN per configuration, plus the
standard-attention speedup and memory ratio (the FlashAttention paper's claim),
ours over the portable kernel (on sm90: the Hopper family's gain) and the
Hopper schedule ablation rows (sm90_*) when present."""
import csv
import sys


def main():
    out, header_file, *inputs = sys.argv[1:]
    rows = []
    for path in inputs:
        try:
            with open(path) as f:
                rows += [r for r in csv.DictReader(f)]
        except FileNotFoundError:
            print(f"missing {path}", file=sys.stderr)
    cols = "kind,dtype,d,b,hq,hkv,sq,sk,causal,impl,ms,tflops,tbps,peak_mem_bytes".split(",")
    with open(out, "w") as f:
        f.write(open(header_file).read())
        f.write(",".join(cols) + "\n")
        for r in rows:
            f.write(",".join(r[c] for c in cols) + "\n")
    key = lambda r: tuple(r[c] for c in "kind,dtype,d,b,hq,hkv,sq,sk,causal".split(","))
    by = {}
    for r in rows:
        by.setdefault(key(r), {})[r["impl"]] = r
    print(f"{'config':38s} {'ours':>8s} {'port':>8s} {'flash':>8s} {'cudnn':>8s} {'o/fl':>6s} {'o/cu':>6s} {'o/port':>6s} {'std_x':>6s} {'mem_x':>6s} {'fa1_x':>6s}")
    for k, impls in by.items():
        if "ours" not in impls:
            continue
        kind = k[0]
        metric = "tbps" if kind == "decode" else "tflops"
        o = float(impls["ours"][metric])
        fl = float(impls["sdpa_flash"][metric]) if "sdpa_flash" in impls else float("nan")
        cu = float(impls["sdpa_cudnn"][metric]) if "sdpa_cudnn" in impls else float("nan")
        stdx = memx = float("nan")
        if "standard" in impls:
            stdx = float(impls["standard"]["ms"]) / float(impls["ours"]["ms"])
            memx = float(impls["standard"]["peak_mem_bytes"]) / float(impls["ours"]["peak_mem_bytes"])
        name = f"{kind[:3]} {k[1]} d{k[2]} b{k[3]} h{k[4]}/{k[5]} {k[6]}x{k[7]}{' c' if k[8] == '1' else ''}"
        fa1x = float(impls["fa1"]["ms"]) / float(impls["ours"]["ms"]) if "fa1" in impls else float("nan")
        po = float(impls["portable"][metric]) if "portable" in impls else float("nan")
        print(f"{name:38s} {o:8.2f} {po:8.2f} {fl:8.2f} {cu:8.2f} {o / fl:6.2f} {o / cu:6.2f} {o / po:6.2f} {stdx:6.2f} {memx:6.2f} {fa1x:6.1f}")
    for k, impls in by.items():
        for name in ("portable", "sm90_tma", "sm90_ws", "sm90_pp", "sm90_ppo", "sm90_persist", "ours"):
            if "sm90_tma" in impls and name in impls:
                print(f"ablation d{k[2]} {k[1]} {k[6]}x{k[7]}{' c' if k[8] == '1' else ''} {name:10s} "
                      f"{float(impls[name]['tflops']):8.1f} TFLOP/s")


if __name__ == "__main__":
    main()
