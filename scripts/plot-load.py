#!/usr/bin/env python3
"""Plots p50 and p99 latency against throughput from `attnctl load --csv` output.

    scripts/plot-load.py load.csv [more.csv ...] [-o load.png] [--title TEXT]

One curve pair (p50 solid, p99 dashed) per series; a series is one input file and,
within it, one (label, protocol, shared memory, mode, stream, channels, shape, dtype,
options) combination, so a CSV that collects several sweeps (for example
--label=batching=on and =off, or --protocol=native and v2) gives several curves. Files
written before the protocol and shm columns existed are native without shared memory.
Points are ordered by throughput. Needs matplotlib; without it, says how to get it and exits 1.
"""
import argparse
import csv
import os
import sys
from collections import OrderedDict


def load_series(paths):
    series = OrderedDict()
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                shape = "B{batch} Sq{seqlen_q} Sk{seqlen_k} Hq{heads_q} Hkv{heads_kv} D{head_dim}".format(
                    **row)
                protocol = row.get("protocol") or "native"
                shm = row.get("shm") or "none"
                key = "{}{} {}{} {} {}{}, {} {} {}".format(
                    row["label"] + ": " if row.get("label") else "",
                    os.path.basename(path), protocol,
                    "" if shm == "none" else " shm=" + shm, row["mode"],
                    "stream" if row["stream"] == "true" else "unary",
                    "" if row["channels"] == "1" else " x{}ch".format(row["channels"]),
                    shape, row["dtype"], row["options"])
                series.setdefault(key, []).append(row)
    return series


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="+", help="CSV files written by attnctl load --csv")
    ap.add_argument("-o", "--output", help="PNG to write (default: first CSV with .png)")
    ap.add_argument("--title", default="attnserve: latency vs throughput")
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot-load.py: matplotlib is not installed; install it with "
              "'apt-get install python3-matplotlib' or 'pip install matplotlib'",
              file=sys.stderr)
        return 1
    output = args.output or os.path.splitext(args.csv[0])[0] + ".png"
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for key, rows in load_series(args.csv).items():
        rows.sort(key=lambda r: float(r["req_per_s"]))
        x = [float(r["req_per_s"]) for r in rows]
        labels = [r["concurrency"] if r["mode"] == "closed" else r["rate"] for r in rows]
        line, = ax.plot(x, [float(r["p50_ms"]) for r in rows], "o-", label=key + " p50")
        ax.plot(x, [float(r["p99_ms"]) for r in rows], "s--", color=line.get_color(),
                label=key + " p99")
        for xi, yi, lab in zip(x, [float(r["p99_ms"]) for r in rows], labels):
            ax.annotate(lab, (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title(args.title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    print("wrote", output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
