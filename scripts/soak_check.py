#!/usr/bin/env python3
"""The soak test's rules over scripts/soak.sh's CSV (columns: soak_sample.py's
HEADER; one row a second; phase "traffic" or "after").

    soak_check.py --check CSV        the growth rule, one line per quantity; exit 1 on growth
    soak_check.py --levels CSV       prints "FDS,THREADS,TIMER_THREADS": their warm-up levels
    soak_check.py --back LEVELS ROW  exit 0 when ROW is back to LEVELS (below)

The rule (issue 15): the traffic rows are cut in fifths; the first fifth is
warm-up; a quantity grows when the median of the last fifth exceeds 1.05 x the
median of the second fifth (the fifth right after warm-up). The warm-up level
of fds and threads is that second fifth's median.

Back after the traffic: fds at most their level, and threads other than
gRPC's timer threads (grpc_global_timer) at most their level. gRPC (1.51,
src/core/lib/iomgr/timer_manager.cc) starts one more timer thread whenever
a timer fires while every timer thread is busy running timers, and stops
them only at shutdown: a high-water mark, not a leak. They may stay up to
one above their warm-up level; more than that is counted as growth.
Queue depth is a count of a few requests (soak_load's five closed-loop
workers keep at most about that many queued), sampled at one instant a second;
its fifth medians move in half-steps from run to run with no trend (2.5 -> 3.0,
3.5 -> 1.0 in 2-minute runs; tests/soak/README.md), so it grows when its last
median exceeds both 1.05 x the second and the second + 1 request.
The heap in use (the allocator's account: what is allocated and not freed)
is printed beside the rule, not judged: it moves with the requests in flight.
"""
import csv
import statistics
import sys

import soak_sample  # the CSV columns (same folder)

QUANTITIES = ("rss_kb", "fds", "threads", "queue_depth", "gpu_mem_mib")
# The smallest growth that counts, per quantity, beside the 1.05x (see above).
RESOLUTION = {"queue_depth": 1.0}
SHOWN = ("heap_in_use_kb", "heap_free_kb", "grpc_timer_threads")
# Timer threads gRPC may add after warm-up and keep (see above).
TIMER_THREADS_SLACK = 1


def traffic_rows(path):
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if r["phase"] == "traffic"]


def fifths(rows, key):
    values = [float(r[key]) for r in rows if r.get(key, "") != ""]
    n = len(values) // 5
    if n == 0:
        raise SystemExit("soak_check: fewer than 5 samples of %s" % key)
    return values[n:2 * n], values[len(values) - n:]


def compare(rows, key):
    second, last = fifths(rows, key)
    a, b = statistics.median(second), statistics.median(last)
    return a, b, "%.3f" % (b / a) if a else "n/a"


def check(path):
    rows = traffic_rows(path)
    grew = False
    for key in QUANTITIES + SHOWN:
        if not any(r.get(key, "") != "" for r in rows):
            continue  # not sampled in this run (gpu_mem_mib without a GPU)
        a, b, ratio = compare(rows, key)
        if key in QUANTITIES:
            ok = b <= 1.05 * a or b <= a + RESOLUTION.get(key, 0.0)
            verdict = "ok" if ok else "GREW"
        elif key == "grpc_timer_threads":
            ok = b <= a + TIMER_THREADS_SLACK
            verdict = "ok (at most +%d)" % TIMER_THREADS_SLACK if ok else "GREW"
        else:
            ok, verdict = True, "(shown, not judged)"
        grew = grew or not ok
        print("soak_check: %-18s second fifth median %12.1f  last fifth median %12.1f  "
              "ratio %s  %s" % (key, a, b, ratio, verdict))
    print("soak_check: %d traffic samples" % len(rows))
    return 1 if grew else 0


def levels(path):
    rows = traffic_rows(path)
    print(",".join("%g" % statistics.median(fifths(rows, key)[0])
                   for key in ("fds", "threads", "grpc_timer_threads")))
    return 0


def back(level_text, row_text):
    fds_level, threads_level, timer_level = (float(x) for x in level_text.split(","))
    header = soak_sample.HEADER.split(",")
    row = dict(zip(header, row_text.split(",")))
    fds, threads, timers = (float(row[k]) for k in ("fds", "threads", "grpc_timer_threads"))
    return 0 if (fds <= fds_level and threads - timers <= threads_level - timer_level and
                 timers <= timer_level + TIMER_THREADS_SLACK) else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--check":
        sys.exit(check(sys.argv[2]))
    if len(sys.argv) == 3 and sys.argv[1] == "--levels":
        sys.exit(levels(sys.argv[2]))
    if len(sys.argv) == 4 and sys.argv[1] == "--back":
        sys.exit(back(sys.argv[2], sys.argv[3]))
    sys.exit(__doc__)
