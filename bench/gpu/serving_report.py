#!/usr/bin/env python3
"""Turns scripts/device/gpu-serving.sh's raw `attnctl load --csv` rows into the serving CSV.

    bench/gpu/serving_report.py serving-raw.csv --env env.txt --out serving.csv [--plot serving.png]

The raw rows carry label = scenario/impl/batching (e.g. small/attnserve/on). The output
starts with `#` lines naming the GPU, driver and versions (from --env, which the script
writes), then one row per (scenario, impl, batching, concurrency) with the columns the
issue asks for and the server-side breakdown. Printed last: the table and the targets
(large: attnserve >= 80% of echo and >= 1.5x python_sdpa; small at concurrency 64:
batching on >= 3x off and >= 3x python_sdpa), each with its measured ratio.
--plot draws p50 (solid) and p99 (dashed) latency against throughput, points joined in
order of concurrency, one panel per scenario (needs matplotlib).
"""
import argparse
import csv
import sys

COLUMNS = ["scenario", "impl", "batching", "concurrency", "req_per_s", "tokens_per_s",
           "p50_ms", "p90_ms", "p99_ms", "max_ms", "errors", "queue_ms", "host_to_device_ms",
           "compute_ms", "device_to_host_ms", "mean_batch_size", "requests_by_device",
           "batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim", "dtype",
           "options", "seconds", "channels"]


def read_rows(path):
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            parts = r["label"].split("/")
            if len(parts) != 3:
                sys.exit(f"serving_report.py: label {r['label']!r} is not scenario/impl/batching")
            r["scenario"], r["impl"], r["batching"] = parts
            rows.append(r)
    return rows


def find(rows, scenario, impl, batching, concurrency):
    for r in rows:
        if (r["scenario"], r["impl"], r["batching"], r["concurrency"]) == (
                scenario, impl, batching, str(concurrency)):
            return r
    return None


def ratio_line(name, num, den, target):
    if num is None or den is None or float(den["req_per_s"]) == 0:
        return f"{name:58s} n/a (missing rows)"
    x = float(num["req_per_s"]) / float(den["req_per_s"])
    verdict = "MET" if x >= target else "NOT MET"
    return (f"{name:58s} {x:6.2f}x  (target {target:g}x: {verdict}; "
            f"{float(num['req_per_s']):.1f} vs {float(den['req_per_s']):.1f} req/s)")


def targets(rows):
    lines = []
    for c in ("1", "4", "8"):
        lines.append(ratio_line(f"large c={c}: attnserve / echo", find(rows, "large", "attnserve", "on", c),
                                find(rows, "large", "echo", "on", c), 0.8))
        lines.append(ratio_line(f"large c={c}: attnserve / python_sdpa",
                                find(rows, "large", "attnserve", "on", c),
                                find(rows, "large", "python_sdpa", "off", c), 1.5))
    on = find(rows, "small", "attnserve", "on", 64)
    lines.append(ratio_line("small c=64: batching on / off", on, find(rows, "small", "attnserve", "off", 64), 3))
    lines.append(ratio_line("small c=64: attnserve / python_sdpa", on,
                            find(rows, "small", "python_sdpa", "off", 64), 3))
    for r in rows:
        if r["impl"].startswith("attnserve-") and r["impl"].endswith("gpu"):
            one = find(rows, r["scenario"], "attnserve", "on", r["concurrency"])
            lines.append(ratio_line(f"{r['scenario']} c={r['concurrency']}: {r['impl']} / attnserve (1 GPU)",
                                    r, one, 1.0))
    return lines


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("serving_report.py: no matplotlib; skipping --plot "
              "(apt-get install python3-matplotlib)", file=sys.stderr)
        return
    scenarios = sorted({r["scenario"] for r in rows}, reverse=True)  # small, large
    # One colour per implementation in every panel.
    keys = sorted({(r["impl"], r["batching"]) for r in rows})
    colors = {k: f"C{i}" for i, k in enumerate(keys)}
    fig, axes = plt.subplots(1, len(scenarios), figsize=(7 * len(scenarios), 5))
    if len(scenarios) == 1:
        axes = [axes]
    for ax, scenario in zip(axes, scenarios):
        series = {}
        for r in rows:
            if r["scenario"] == scenario:
                series.setdefault((r["impl"], r["batching"]), []).append(r)
        for (impl, batching), pts in sorted(series.items()):
            pts.sort(key=lambda r: int(r["concurrency"]))
            x = [float(r["req_per_s"]) for r in pts]
            name = f"{impl} (batching {batching})" if impl.startswith("attnserve") else impl
            color = colors[(impl, batching)]
            ax.plot(x, [float(r["p50_ms"]) for r in pts], "o-", color=color, label=name + " p50")
            ax.plot(x, [float(r["p99_ms"]) for r in pts], "s--", color=color, label=name + " p99")
            for r, xi in zip(pts, x):
                ax.annotate("c" + r["concurrency"], (xi, float(r["p99_ms"])),
                            textcoords="offset points", xytext=(3, 3), fontsize=7)
        r0 = next(r for r in rows if r["scenario"] == scenario)
        ax.set_title(f"{scenario}: B={r0['batch']} S={r0['seqlen_q']} Hq={r0['heads_q']} "
                     f"D={r0['head_dim']} {r0['dtype']}")
        ax.set_xlabel("throughput (requests/s)")
        ax.set_ylabel("client latency (ms)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", help="serving-raw.csv from scripts/device/gpu-serving.sh")
    ap.add_argument("--env", help="env.txt from scripts/device/gpu-serving.sh (GPU, driver, versions)")
    ap.add_argument("--out", required=True, help="the serving CSV to write")
    ap.add_argument("--plot", help="PNG to draw (needs matplotlib)")
    args = ap.parse_args()
    rows = read_rows(args.raw)
    with open(args.out, "w", newline="") as f:
        f.write("# attnserve serving benchmark (scripts/device/gpu-serving.sh; server and load client on one host)\n")
        if args.env:
            with open(args.env) as e:
                for line in e:
                    if line.strip():
                        f.write("# " + line.rstrip("\n") + "\n")
        f.write("# req_per_s counts successful requests; tokens_per_s counts query tokens (B*Sq); "
                "latency is the client's; *_ms server columns are means\n")
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    print(f"{'scenario':8s} {'impl':18s} {'batch':5s} {'conc':>4s} {'req/s':>9s} {'p50 ms':>8s} "
          f"{'p99 ms':>8s} {'errors':>6s} {'queue':>7s} {'h2d':>7s} {'compute':>7s} {'d2h':>7s} {'bsz':>5s}")
    for r in rows:
        print(f"{r['scenario']:8s} {r['impl']:18s} {r['batching']:5s} {r['concurrency']:>4s} "
              f"{float(r['req_per_s']):9.1f} {float(r['p50_ms']):8.2f} {float(r['p99_ms']):8.2f} "
              f"{r['errors']:>6s} {float(r['queue_ms']):7.2f} {float(r['host_to_device_ms']):7.2f} "
              f"{float(r['compute_ms']):7.2f} {float(r['device_to_host_ms']):7.2f} "
              f"{float(r['mean_batch_size']):5.1f}")
    print("---- targets")
    for line in targets(rows):
        print(line)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
