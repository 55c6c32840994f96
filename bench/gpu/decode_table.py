#!/usr/bin/env python3
"""Prints the split-KV decode table of scripts/device/gpu-decode.sh from its merged
CSV (attn_bench/sdpa_bench rows; '#' lines skipped): per shape, TB/s of K+V
read for the branch point (ours_base: separate combine kernel), this tree
with the separate combine (ours_separate) and with the fused one (ours),
the paged decode (paged16), SDPA FLASH and cuDNN; then fused / separate,
fused / base, and ours and paged16 / max(FLASH, cuDNN). Chunked-prefill
rows (kind prefill) are compared in TFLOP/s. Then the split-count sweep
(ours_s<N>: --decode_splits=N) as TB/s per shape.
Usage: decode_table.py MERGED.csv"""
import csv
import re
import sys


def main():
    rows = list(csv.DictReader(l for l in open(sys.argv[1]) if not l.startswith("#")))
    by = {}
    for r in rows:
        key = (r["kind"], int(r["b"]), int(r["sq"]), int(r["sk"]))
        by.setdefault(key, {})[r["impl"]] = r
    impls = ["ours_base", "ours_separate", "ours", "paged16", "sdpa_flash", "sdpa_cudnn"]
    print(f"{'shape':22s} " + " ".join(f"{n[-9:]:>9s}" for n in impls) +
          "   fus/sep fus/base  o/best p16/best   (TB/s decode, TFLOP/s prefill)")
    for key in sorted(by):
        kind, b, sq, sk = key
        metric = "tbps" if kind == "decode" else "tflops"
        v = {n: float(by[key][n][metric]) if n in by[key] else None for n in impls}
        ratio = lambda a, d: f"{a / d:8.3f}" if a and d else f"{'-':>8s}"
        best = max(x for x in (v["sdpa_flash"], v["sdpa_cudnn"], 0.0) if x is not None) or None
        cells = " ".join(f"{v[n]:9.3f}" if v[n] else f"{'-':>9s}" for n in impls)
        print(f"{kind[:3]} b{b:<3d} q{sq:<4d} k{sk:<6d} {cells}  {ratio(v['ours'], v['ours_separate'])} "
              f"{ratio(v['ours'], v['ours_base'])} {ratio(v['ours'], best)} {ratio(v['paged16'], best)}")
    sweep = sorted({int(m.group(1)) for r in by.values() for n in r for m in [re.fullmatch(r"ours_s(\d+)", n)] if m})
    if sweep:
        print("\nsplit sweep (TB/s; planner's choice = ours):")
        print(f"{'shape':22s} " + " ".join(f"{'s' + str(s):>7s}" for s in sweep) + f" {'ours':>7s}")
        for key in sorted(by):
            if key[0] != "decode":
                continue
            cells = " ".join(f"{float(by[key]['ours_s%d' % s]['tbps']):7.3f}" if f"ours_s{s}" in by[key]
                             else f"{'-':>7s}" for s in sweep)
            o = by[key].get("ours")
            print(f"dec b{key[1]:<3d} q{key[2]:<4d} k{key[3]:<6d} {cells} {float(o['tbps']) if o else 0:7.3f}")


if __name__ == "__main__":
    main()
