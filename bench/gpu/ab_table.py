#!/usr/bin/env python3
"""The A/B table of scripts/device/ab-serving.sh: the decode loop's tokens/s and
step p50 per tree, configuration and round (new/old ratio of the rounds'
means), and attn_bench's quick grid per shape (new/old TFLOP/s or TB/s).
Usage: ab_table.py AB_LOOP_CSV AB_BENCH_CSV"""
import csv
import sys
from collections import defaultdict


def rows(path):
    with open(path) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def loop_table(path):
    by = defaultdict(list)  # (tree, config) -> [(tokens/s, p50)]
    for r in rows(path):
        tree, rnd, config = r["label"].split("-", 2)
        by[(tree, config)].append((float(r["tokens_per_s"]), float(r["p50_ms"])))
    print(f"{'decode loop 64x8k':<22}{'tree':<6}{'tok/s per round':<28}{'p50 ms per round':<24}")
    for config in sorted({c for _, c in by}):
        mean = {}
        for tree in ("old", "new"):
            vals = by.get((tree, config), [])
            if not vals:
                continue
            mean[tree] = sum(v[0] for v in vals) / len(vals)
            print(f"{config:<22}{tree:<6}{' '.join(f'{v[0]:.0f}' for v in vals):<28}"
                  f"{' '.join(f'{v[1]:.3f}' for v in vals):<24}")
        if len(mean) == 2:
            print(f"{config:<22}new/old tokens/s {mean['new'] / mean['old']:.3f}")


def bench_table(path):
    by = defaultdict(dict)
    for r in rows(path):
        key = (r["kind"], r["d"], r["b"], r["sq"], r["sk"], r["causal"])
        metric = float(r["tflops"] or 0) if r["kind"] == "prefill" else float(r["tbps"] or 0)
        by[key][r["impl"]] = metric
    print(f"\n{'kind':<8}{'d':>4}{'b':>4}{'sq':>7}{'sk':>7}{'causal':>7}{'old':>9}{'new':>9}{'new/old':>9}")
    for key, m in sorted(by.items()):
        if "old" in m and "new" in m and m["old"] > 0:
            print(f"{key[0]:<8}{key[1]:>4}{key[2]:>4}{key[3]:>7}{key[4]:>7}{key[5]:>7}"
                  f"{m['old']:>9.1f}{m['new']:>9.1f}{m['new'] / m['old']:>9.3f}")


if __name__ == "__main__":
    loop_table(sys.argv[1])
    bench_table(sys.argv[2])
