#!/usr/bin/env python3
"""The soak test's rules over scripts/soak.sh's CSV (columns: soak_sample.py's
HEADER; one row a second; phase "traffic" or "after").

    soak_check.py --check CSV CONCURRENCY
                                     the growth rule, one line per quantity; exit 1 on growth
                                     (CONCURRENCY: calls the load keeps in flight; below)
    soak_check.py --levels CSV       prints "FDS,THREADS,TIMER_THREADS": their warm-up levels
    soak_check.py --back LEVELS ROW  exit 0 when ROW is back to LEVELS (below)
    soak_check.py --budget CSV BYTES the memory rule (below); exit 1 when broken
    soak_check.py --rest BEFORE AFTER [--report]
                                     the rest rule (below): exit 0 when row AFTER (after the
                                     traffic) is back to row BEFORE (before it); --report prints

The rule: the traffic rows are cut in fifths; the first fifth is
warm-up; a quantity grows when the median of the last fifth exceeds 1.05 x the
median of the second fifth (the fifth right after warm-up); RSS, 1.25 x (why:
below). The warm-up level of fds and threads is that second fifth's median.

The rest rule, the one that catches a leak: the server at rest, before the
traffic (after the peak phase) and after it (polled each second for up to
60 s, while caches the traffic abandoned expire), must hold the same: heap in
use (the allocator's account of bytes not freed) at most REST_HEAP_SLACK_BYTES
more, anonymous RSS (heap, thread stacks, every other private mapping) at most
REST_ANON_SLACK_BYTES more. At rest nothing is in flight, so these are what
the server keeps (heap in use 0.6 MB before and 1.1-2.1 MB after the
traffic in every 2-minute run since the hostile clients came). During the
traffic RSS is mostly bytes in flight (heap in use 18-66 MB of 60-105 MB),
which move with the machine's load: RSS's fifths moved 0.955-1.176 in healthy
runs while the free heap, thread stacks and mapped files stayed flat, so the
fifths rule for RSS (1.25 x) only catches growth that is gone when the
traffic stops. A server leaking 32 B per gRPC batch (about 80 B per call)
passes it (1.207) and fails the rest rule (heap in use 10.6 MB above rest);
one leaking 256 B fails both (1.345; 44.7 MB) (tests/soak/README.md).

Back after the traffic: fds at most their level, and threads other than
gRPC's timer threads (grpc_global_timer) at most their level. gRPC (1.51,
src/core/lib/iomgr/timer_manager.cc) starts one more timer thread whenever
a timer fires while every timer thread is busy running timers, and stops
them only at shutdown: a high-water mark, not a leak. They may stay up to
one above their warm-up level; more than that is counted as growth.
Queue depth is judged by its trend, not by the fifths' medians: it is a
count of a few requests (0 to 14 in every run so far), sampled at one instant
a second, and the medians of 24 such samples moved by up to 2.5 requests with
the machine's load and no trend (3.0 -> 5.5 failed a 2-minute run). It grows
when the least-squares line through the samples after warm-up rises, from the
first of them to the last, by more than CONCURRENCY: the calls the load
generator keeps in flight at once (soak_load's closed-loop workers). A rise of
that many is more than where the workers happen to be at the sampled instants
can make: requests stay queued. Over 170 two-minute windows of a 30-minute
run the line rose by at most 2.0 (s.d. 0.8); a queue that keeps one request
every 15 s rises by 6.4 over a 2-minute run's last 96 s and fails.
The heap in use (the allocator's account: what is allocated and not freed)
is printed beside the rule, not judged: it moves with the requests in flight.

The memory rule (--budget): every RSS sample of the run (rss_kb and
rss_now_kb, traffic and after) stays at most BYTES (the server's
--max_buffered_bytes) plus BUDGET_SLACK_BYTES, the stated constant: what the
server holds whatever its callers do (code, thread stacks, pools, gRPC's
transport buffers outside its quota, allocator slack; the server alone sat
at 40-70 MB through the soaks before hostile clients were added).
"""
import csv
import statistics
import sys

import soak_sample  # the CSV columns (same folder)

# Judged by the fifths' medians: at most GROWTH_LIMIT x, or their own limit.
QUANTITIES = ("rss_kb", "fds", "threads", "gpu_mem_mib")
GROWTH_LIMIT = 1.05
# RSS during the traffic is mostly bytes in flight (see above); leaks are the
# rest rule's.
GROWTH_LIMITS = {"rss_kb": 1.25}
# The rest rule's allowances (see above).
REST_HEAP_SLACK_BYTES = 4 << 20
REST_ANON_SLACK_BYTES = 16 << 20
# Judged by its trend line against the load's concurrency (see above).
QUEUE = "queue_depth"
SHOWN = ("heap_in_use_kb", "heap_free_kb", "rss_now_kb", "grpc_timer_threads", "rss_anon_kb",
         "rss_file_kb", "rss_shmem_kb", "heap_rss_kb", "stacks_rss_kb")
# Timer threads gRPC may add after warm-up and keep (see above).
TIMER_THREADS_SLACK = 1
# The memory rule's constant (see above).
BUDGET_SLACK_BYTES = 128 << 20


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


def rise(values):
    """How much the least-squares line through values rises from the first
    sample to the last (samples evenly spaced)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, statistics.fmean(values)
    sxx = sum((x - mean_x) ** 2 for x in range(n))
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values))
    return sxy / sxx * (n - 1)


def check_queue(rows, concurrency):
    """The queue-depth rule; prints its line, returns True when it passes."""
    values = [float(r[QUEUE]) for r in rows if r.get(QUEUE, "") != ""]
    if len(values) < 5:
        raise SystemExit("soak_check: fewer than 5 samples of %s" % QUEUE)
    second, last = fifths(rows, QUEUE)
    after_warm_up = values[len(values) // 5:]
    up = rise(after_warm_up)
    ok = up <= concurrency
    print("soak_check: %-18s second fifth median %12.1f  last fifth median %12.1f  "
          "trend after warm-up %+.2f over %d samples (at most +%d, the load's concurrency)  %s"
          % (QUEUE, statistics.median(second), statistics.median(last), up,
             len(after_warm_up), concurrency, "ok" if ok else "GREW"))
    return ok


def check(path, concurrency):
    rows = traffic_rows(path)
    grew = not check_queue(rows, concurrency)
    for key in QUANTITIES + SHOWN:
        if not any(r.get(key, "") != "" for r in rows):
            continue  # not sampled in this run (gpu_mem_mib without a GPU)
        a, b, ratio = compare(rows, key)
        if key in QUANTITIES:
            limit = GROWTH_LIMITS.get(key, GROWTH_LIMIT)
            ok = b <= limit * a
            verdict = ("ok" if ok else "GREW") + " (at most %.2f)" % limit
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


def budget(path, limit_bytes):
    """The memory rule; prints its line, returns the exit status."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    peak_kb = max((float(r[k]) for r in rows for k in ("rss_kb", "rss_now_kb")
                   if r.get(k, "") != ""), default=0.0)
    bound_kb = (limit_bytes + BUDGET_SLACK_BYTES) / 1024
    ok = 0 < peak_kb <= bound_kb
    print("soak_check: peak RSS %.1f MB, bound %.1f MB (budget %.1f MB + %.0f MB)  %s"
          % (peak_kb / 1024, bound_kb / 1024, limit_bytes / 2**20, BUDGET_SLACK_BYTES / 2**20,
             "ok" if ok else "OVER"))
    return 0 if ok else 1


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


def rest(before_text, after_text, report=False):
    """The rest rule over two rows (soak_sample.py --once); 0 when it holds."""
    header = soak_sample.HEADER.split(",")
    before = dict(zip(header, before_text.split(",")))
    after = dict(zip(header, after_text.split(",")))
    ok = True
    lines = []
    for key, slack in (("heap_in_use_kb", REST_HEAP_SLACK_BYTES),
                       ("rss_anon_kb", REST_ANON_SLACK_BYTES)):
        if before.get(key, "") == "" or after.get(key, "") == "":
            ok = False
            lines.append("%s not read" % key)
            continue
        a, b = float(before[key]), float(after[key])
        held = b <= a + slack / 1024
        ok = ok and held
        lines.append("%s %.1f MB before the traffic, %.1f MB after (at most +%d MB) %s"
                     % (key, a / 1024, b / 1024, slack >> 20, "ok" if held else "HELD"))
    if report:
        for line in lines:
            print("soak_check: at rest: " + line)
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) in (4, 5) and sys.argv[1] == "--rest":
        sys.exit(rest(sys.argv[2], sys.argv[3], report=sys.argv[4:] == ["--report"]))
    if len(sys.argv) == 4 and sys.argv[1] == "--check":
        sys.exit(check(sys.argv[2], int(sys.argv[3])))
    if len(sys.argv) == 4 and sys.argv[1] == "--budget":
        sys.exit(budget(sys.argv[2], int(sys.argv[3])))
    if len(sys.argv) == 3 and sys.argv[1] == "--levels":
        sys.exit(levels(sys.argv[2]))
    if len(sys.argv) == 4 and sys.argv[1] == "--back":
        sys.exit(back(sys.argv[2], sys.argv[3]))
    sys.exit(__doc__)
