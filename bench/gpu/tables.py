#!/usr/bin/env python3
"""Summary tables of attn_bench/sdpa_bench CSVs for the GPU round scripts, so
their CSV reading lives in Python files beside merge_results.py instead of
shell heredocs.

  tables.py ab OUT      ours / alt (an A/B build) / SDPA FLASH and CUDNN /
                        the kvread floor, from OUT/{ours,alt_all,sdpa}.csv
                        (bench/gpu/ab_quick.sh)
  tables.py splits OUT  decode TB/s by --decode_splits, from OUT/split<N>.csv
                        (bench/gpu/final_round.sh)
"""
import csv
import glob
import re
import sys


def read_rows(path):
    """The rows of one CSV as dicts; [] and a note when the file is missing."""
    try:
        with open(path) as f:
            return list(csv.DictReader(f))
    except FileNotFoundError:
        print("missing", path.rsplit("/", 1)[-1])
        return []


def ab_table(out):
    rows = {}
    key = lambda r: (r["kind"], r["d"], r["b"], r["sq"], r["sk"], r["causal"])
    for name, f in (("ours", "ours.csv"), ("alt", "alt_all.csv"), ("sdpa", "sdpa.csv")):
        for r in read_rows(f"{out}/{f}"):
            impl = r["impl"] if name == "sdpa" or r["impl"] == "kvread" else name
            rows.setdefault(key(r), {})[impl] = r
    print(f"{'config':28s} {'ours':>7s} {'alt':>7s} {'flash':>7s} {'cudnn':>7s} {'o/fl':>5s} {'a/fl':>5s} {'o/cu':>5s} {'floor':>6s}")
    for k, d in rows.items():
        if "ours" not in d:
            continue
        m = "tbps" if k[0] == "decode" else "tflops"
        g = lambda i: float(d[i][m]) if i in d else float("nan")
        o, a, fl, cu, fr = g("ours"), g("alt"), g("sdpa_flash"), g("sdpa_cudnn"), g("kvread")
        name = f"{k[0][:3]} d{k[1]} b{k[2]} {k[3]}x{k[4]}{' c' if k[5] == '1' else ''}"
        print(f"{name:28s} {o:7.2f} {a:7.2f} {fl:7.2f} {cu:7.2f} {o/fl:5.2f} {a/fl:5.2f} {o/cu:5.2f} {fr:6.2f}")


def splits_table(out):
    t = {}
    for f in glob.glob(f"{out}/split*.csv"):
        s = int(re.search(r"split(\d+)", f).group(1))
        for r in read_rows(f):
            t.setdefault((r["b"], r["sk"]), {})[s] = float(r["tbps"])
    print("decode TB/s by split count (0 = planner):")
    for k, v in sorted(t.items(), key=lambda kv: int(kv[0][0])):
        print(f"  B={k[0]:>3} Sk={k[1]:>6}: " + " ".join(f"{s}:{v[s]:.2f}" for s in sorted(v)))


def main():
    tables = {"ab": ab_table, "splits": splits_table}
    if len(sys.argv) != 3 or sys.argv[1] not in tables:
        sys.exit(f"usage: {sys.argv[0]} ab|splits OUT_DIR")
    tables[sys.argv[1]](sys.argv[2])


if __name__ == "__main__":
    main()
