#!/usr/bin/env python3
"""Plots scripts/soak.sh's CSV as an SVG (standard library only: the CI machine
has no matplotlib): one panel each for RSS, heap in use (the allocator's
account), open fds, threads and queue depth against time, the warm-up fifth shaded, the second and last fifths (the windows
the growth rule compares) marked, and the after-traffic samples in grey.

    scripts/plot-soak.py soak.csv [-o soak.svg] [--title TEXT]
"""
import argparse
import csv

PANELS = (("rss_kb", "RSS (MB)", 1 / 1024.0), ("heap_in_use_kb", "heap in use (MB)", 1 / 1024.0),
          ("fds", "open fds", 1.0),
          ("threads", "threads", 1.0), ("queue_depth", "queue depth", 1.0))
W, H, LEFT, RIGHT, TOP, GAP = 900, 170, 70, 20, 40, 30


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("-o", "--output", default="soak.svg")
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    t0 = float(rows[0]["time_s"])
    times = [float(r["time_s"]) - t0 for r in rows]
    n_traffic = sum(1 for r in rows if r["phase"] == "traffic")
    fifth = n_traffic // 5
    t_end = max(times[-1], 1.0)
    title = args.title or "soak: %d s of traffic, %d samples" % (
        times[n_traffic - 1] if n_traffic else 0, len(rows))
    height = TOP + len(PANELS) * (H + GAP)
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" '
           'font-family="sans-serif" font-size="11">' % (W, height),
           '<rect width="100%" height="100%" fill="white"/>',
           '<text x="%d" y="22" font-size="14">%s</text>' % (LEFT, title)]
    x = lambda t: LEFT + (W - LEFT - RIGHT) * t / t_end
    for i, (key, label, scale) in enumerate(PANELS):
        top = TOP + i * (H + GAP)
        vals = [float(r[key]) * scale if r.get(key) else None for r in rows]
        present = [v for v in vals if v is not None] or [0.0]
        lo, hi = min(0.0, min(present)), max(present) * 1.1 or 1.0
        y = lambda v: top + H - H * (v - lo) / (hi - lo)
        if fifth:
            out.append('<rect x="%.1f" y="%d" width="%.1f" height="%d" fill="#eee"/>' %
                       (x(times[0]), top, x(times[fifth]) - x(times[0]), H))
            for a, b in ((fifth, 2 * fifth), (n_traffic - fifth, n_traffic - 1)):
                out.append('<rect x="%.1f" y="%d" width="%.1f" height="%d" fill="#dde8ff"/>' %
                           (x(times[a]), top, x(times[b]) - x(times[a]), H))
        out.append('<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#888"/>' %
                   (LEFT, top, W - LEFT - RIGHT, H))
        out.append('<text x="5" y="%d">%s</text>' % (top + 12, label))
        out.append('<text x="5" y="%d">%.4g</text>' % (top + 26, hi))
        out.append('<text x="5" y="%d">%.4g</text>' % (top + H, lo))
        for phase, colour in (("traffic", "#1f5fbf"), ("after", "#999")):
            pts = ["%.1f,%.1f" % (x(t), y(v)) for t, v, r in zip(times, vals, rows)
                   if v is not None and r["phase"] == phase]
            if pts:
                out.append('<polyline fill="none" stroke="%s" stroke-width="1.2" points="%s"/>' %
                           (colour, " ".join(pts)))
    out.append('<text x="%d" y="%d">time (s); grey band: warm-up fifth; blue bands: the '
               'second and last fifths the growth rule compares; grey line: after the traffic'
               '</text>' % (LEFT, height - 8))
    out.append("</svg>")
    with open(args.output, "w") as f:
        f.write("\n".join(out))


if __name__ == "__main__":
    main()
