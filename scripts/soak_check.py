#!/usr/bin/env python3
"""The soak test's rules over scripts/soak.sh's CSV (time_s, phase, rss_kb, fds,
threads, queue_depth; one row a second; phase "traffic" or "after").

    soak_check.py --check CSV        the growth rule, one line per quantity; exit 1 on growth
    soak_check.py --levels CSV       prints "FDS,THREADS": their warm-up levels
    soak_check.py --back LEVELS ROW  exit 0 when ROW's fds and threads are <= LEVELS

The rule (issue 15): the traffic rows are cut in fifths; the first fifth is
warm-up; a quantity grows when the median of the last fifth exceeds 1.05 x the
median of the second fifth (the fifth right after warm-up). The warm-up level
of fds and threads is that second fifth's median.
"""
import csv
import statistics
import sys

QUANTITIES = ("rss_kb", "fds", "threads", "queue_depth")


def traffic_rows(path):
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if r["phase"] == "traffic"]


def fifths(rows, key):
    values = [float(r[key]) for r in rows if r[key] != ""]
    n = len(values) // 5
    if n == 0:
        raise SystemExit("soak_check: fewer than 5 samples of %s" % key)
    return values[n:2 * n], values[len(values) - n:]


def check(path):
    rows = traffic_rows(path)
    grew = False
    for key in QUANTITIES:
        second, last = fifths(rows, key)
        a, b = statistics.median(second), statistics.median(last)
        ok = b <= 1.05 * a
        grew = grew or not ok
        print("soak_check: %-11s second fifth median %12.1f  last fifth median %12.1f  "
              "ratio %s  %s" % (key, a, b, "%.3f" % (b / a) if a else "n/a",
                                "ok" if ok else "GREW"))
    print("soak_check: %d traffic samples" % len(rows))
    return 1 if grew else 0


def levels(path):
    rows = traffic_rows(path)
    fds = statistics.median(fifths(rows, "fds")[0])
    threads = statistics.median(fifths(rows, "threads")[0])
    print("%g,%g" % (fds, threads))
    return 0


def back(level_text, row_text):
    fds_level, threads_level = (float(x) for x in level_text.split(","))
    row = row_text.split(",")
    return 0 if float(row[3]) <= fds_level and float(row[4]) <= threads_level else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--check":
        sys.exit(check(sys.argv[2]))
    if len(sys.argv) == 3 and sys.argv[1] == "--levels":
        sys.exit(levels(sys.argv[2]))
    if len(sys.argv) == 4 and sys.argv[1] == "--back":
        sys.exit(back(sys.argv[2], sys.argv[3]))
    sys.exit(__doc__)
