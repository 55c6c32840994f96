#!/usr/bin/env python3
"""Plots and tabulates issue 25's committed mask measurements (bench/results).

    bench/plot-masks.py [CSV[=LABEL[|LABEL2...]] ...] [-o masks.png] [--no-plot]

Reads mask_bench CSVs (raw, or merged with their peers by mask_table.py: columns peer,
peer_ms, speedup_vs_peer) and sm90_block_sparse_test's timing CSVs (d, n, pattern,
s_kept, ratio_to_s_dense), '#' lines skipped. A file that holds several runs of the same
grid one after another (a case seen again starts the next run) takes one label per run,
separated by '|'. Without arguments: the committed CSVs below. Prints one text table per
grid (sparse: ms / (kept x plain ms) per kept fraction, target <= 1.15, and the speedup
over FlexAttention, target >= 1; bias and mods: ms / plain ms, targets <= 1.25 (>= 0.8x
plain speed) and <= 1.05, and the speedup over SDPA); with matplotlib, also a PNG of the
same (default bench/results/masks-plot.png). Without matplotlib the tables alone, and it
says so.
"""
import argparse
import csv
import os
import sys
from collections import OrderedDict

HERE = os.path.dirname(os.path.abspath(__file__))
R = os.path.join(HERE, "results")
# The committed runs, oldest first: (path under bench/results, label per run in the file).
DEFAULT = [
    ("masks-h200-2026-11-27/sparse-final.csv", "11-27 8d9c522"),
    ("sm90-block-sparse-h200-2026-11-27/timing-final.csv", "11-27 c07c02b test harness"),
    ("session-2026-11-28-s36/masks-sparse-order-h200.csv",
     "s36 0959643 longest-first|s36 0959643 natural order"),
    ("masks-h200-2026-11-27/bias-final.csv", "11-27 8d9c522 fragment words"),
    ("session-2026-11-28-s36/masks-bias-rows-h200.csv",
     "s36 0959643 whole rows|s36 0959643 fragment words"),
    ("masks-h200-2026-11-27/mods-final.csv", "11-27 8d9c522"),
    ("session-2026-11-28-s33/mods-h200-split.csv", "s33 split kernels"),
]
TARGET = {"sparse": 1.15, "bias": 1.25, "mods": 1.05}


def rows_of(path, labels):
    """Normalised rows: grid, label, d, n, pattern (sparse) or mods, kept, ratio, peer, x_peer, tbps."""
    with open(path, newline="") as f:
        lines = [l for l in f if not l.startswith("#")]
    out, seen, run = [], set(), 0
    for r in csv.DictReader(lines):
        if "ratio_to_s_dense" in r:  # sm90_block_sparse_test's timing CSV
            if r["pattern"] == "dense":
                continue
            r = {"grid": "sparse", "d": r["d"], "n": r["n"], "pattern": r["pattern"],
                 "mods": "none", "kept": r["s_kept"], "s": r["s_target"],
                 "bound_ratio": r["ratio_to_s_dense"]}
        key = (r["grid"], r["d"], r["n"], r["pattern"], r["mods"], r.get("s"))
        if key in seen:  # the next run of the same grid
            run, seen = run + 1, set()
        seen.add(key)
        label = labels[min(run, len(labels) - 1)] + ("" if run < len(labels) else f" run {run + 1}")
        x = r.get("speedup_vs_peer") or ""
        out.append({
            "grid": r["grid"], "label": label, "d": int(r["d"]), "n": int(r["n"]),
            "what": r["pattern"] if r["grid"] == "sparse" else r["mods"],
            "kept": float(r["kept"]), "ratio": float(r["bound_ratio"]),
            "peer": (r.get("peer") or "").replace("sdpa_", "SDPA "), "x_peer": float(x) if x else None,
            "tbps": float(r["bias_tbps"]) if r.get("bias_tbps") else None})
    return out


def series(rows, grid):
    """(label, d, what) -> rows of one grid, in file order."""
    s = OrderedDict()
    for r in rows:
        if r["grid"] == grid:
            s.setdefault((r["label"], r["d"], r["what"]), []).append(r)
    return s


def tables(rows):
    sparse = series(rows, "sparse")
    if sparse:
        print("block-sparse: ms / (kept x plain ms), target <= 1.15; [x peer] = peer ms / ours")
        print(f"{'run':34} {'d':>3} {'pattern':8} {'n':>6}  bound at kept fraction (x peer)")
        for (label, d, what), rs in sparse.items():
            for n in sorted({r["n"] for r in rs}):
                cells = " ".join(f"{r['kept']:.3f}:{r['ratio']:.2f}" + (f"[{r['x_peer']:.2f}]" if r["x_peer"] else "")
                                 for r in rs if r["n"] == n)
                print(f"{label[:34]:34} {d:>3} {what:8} {n:>6}  {cells}")
    for grid in ("bias", "mods"):
        s = series(rows, grid)
        if not s:
            continue
        print(f"\n{grid}: ms / plain ms, target <= {TARGET[grid]}"
              + ("; TB/s of the bias read; [x peer] = peer ms / ours" if grid == "bias" else ""))
        for (label, d, what), rs in s.items():
            cells = " ".join(f"n={r['n']}:{r['ratio']:.3f}" + (f"/{r['tbps']:.2f}TB/s" if grid == "bias" and r["tbps"] else "")
                             + (f"[{r['peer']} {r['x_peer']:.2f}]" if r["x_peer"] else "") for r in rs)
            print(f"{label[:34]:34} d{d} {what:12} {cells}")


def plot(rows, output):
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(14, 9))
    # A colour per case (head dim, pattern or modifier, N), a line style per run.
    colours, styles = {}, {}
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def look(label, case):
        c = colours.setdefault(case, cycle[len(colours) % len(cycle)])
        ls = styles.setdefault(label, ["-", "--", "-.", ":"][len(styles) % 4])
        return {"color": c, "ls": ls}

    a = ax[0][0]
    for (label, d, what), rs in series(rows, "sparse").items():
        for n in sorted({r["n"] for r in rs}):
            pts = sorted((r["kept"], r["ratio"]) for r in rs if r["n"] == n)
            a.plot(*zip(*pts), marker="o", ms=3, lw=1, label=f"{label} D{d} {what} N{n // 1024}k",
                   **look(label, (d, what, n)))
    a.axhline(TARGET["sparse"], color="k", ls="--", lw=1)
    a.set(xscale="log", xlabel="kept fraction of blocks", ylabel="ms / (kept x dense ms)",
          title="block-sparse: cost per kept block (target <= 1.15)")
    a.legend(fontsize=5, ncol=2)
    a = ax[0][1]
    for (label, d, what), rs in series(rows, "sparse").items():
        for n in sorted({r["n"] for r in rs}):
            pts = sorted((r["kept"], r["x_peer"]) for r in rs if r["n"] == n and r["x_peer"])
            if pts:
                a.plot(*zip(*pts), marker="o", ms=3, lw=1, label=f"{label} D{d} {what} N{n // 1024}k",
                       **look(label, (d, what, n)))
    a.axhline(1.0, color="k", ls="--", lw=1)
    a.set(xscale="log", xlabel="kept fraction of blocks", ylabel="FlexAttention ms / ours",
          title="block-sparse vs compiled FlexAttention, same masks (target >= 1)")
    a.legend(fontsize=5, ncol=2)
    for a, grid, title in ((ax[1][0], "bias", "additive bias [1, 1 or H, N, N] BF16 (target <= 1.25)"),
                           (ax[1][1], "mods", "ALiBi and sinks (target <= 1.05)")):
        for (label, d, what), rs in series(rows, grid).items():
            pts = sorted((r["n"], r["ratio"]) for r in rs)
            a.plot(*zip(*pts), marker="o", ms=3, lw=1, label=f"{label} {what}", **look(label, (grid, what)))
            if grid == "bias":
                peer = sorted((r["n"], r["ratio"] * r["x_peer"]) for r in rs if r["x_peer"])
                if peer:
                    a.plot(*zip(*peer), marker="x", ms=4, lw=1.5, label=f"{label} {what}: SDPA attn_mask ms / our plain ms",
                           **look(label + " SDPA", (grid, what + " SDPA")))
        a.axhline(TARGET[grid], color="k", ls="--", lw=1)
        a.set(xscale="log", xlabel="N (= Sq = Sk; B x N = 16k tokens)", ylabel="ms / our plain kernel's ms",
              title=title)
        a.legend(fontsize=6)
    fig.suptitle("attnserve masks on H200 (bench/results; NOTES-masks.md explains each run)")
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    print(f"\nwrote {output}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="*", help="CSV[=LABEL|LABEL2...] (default: the committed runs)")
    ap.add_argument("-o", "--output", default=os.path.join(R, "masks-plot.png"))
    ap.add_argument("--no-plot", action="store_true", help="the text tables only")
    args = ap.parse_args()
    specs = [(os.path.join(R, p), l) for p, l in DEFAULT] if not args.csv else \
        [(c.split("=", 1)[0], c.split("=", 1)[1] if "=" in c else os.path.basename(c)) for c in args.csv]
    rows = []
    for path, labels in specs:
        rows += rows_of(path, labels.split("|"))
    tables(rows)
    if args.no_plot:
        return 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("\nplot-masks.py: matplotlib is not installed (pip install matplotlib): tables only",
              file=sys.stderr)
        return 0
    plot(rows, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
