#!/usr/bin/env python3
"""scripts/soak.sh's sampler: once a second (on the clock, so slow reads do not
stretch the interval) appends one CSV row of a process's state until
PHASE_FILE is removed. One long-lived process, because a process per sample
takes longer than the interval on a loaded 2-core machine.

    soak_sample.py PID METRICS_URL CSV PHASE_FILE   the loop
    soak_sample.py --once PID METRICS_URL PHASE     prints one row (no header)
    soak_sample.py --header                         prints the CSV header

Columns (HEADER): time_s, phase; rss_kb (below), fds, threads from /proc; queue_depth
(nv_inference_pending_request_count), heap_in_use_kb and heap_free_kb (the
allocator's account: attnserve_heap_in_use_bytes, attnserve_heap_free_bytes)
from METRICS_URL; grpc_timer_threads: threads named grpc_global_timer, gRPC's
timer pool, which gRPC grows when all its timer threads are busy and never
shrinks before shutdown (tests/soak/README.md); gpu_mem_mib: memory used on
GPU $ATTNSERVE_SOAK_GPU (nvidia-smi; empty when that is unset), for a server
with the CUDA backend and the GPU to itself; rss_now_kb: one read of RSS at the
row's instant (shown, not judged); what that RSS is made of, read at the same
instant (shown, not judged): rss_anon_kb, rss_file_kb, rss_shmem_kb
(/proc/PID/status: anonymous memory, mapped files such as the code, shared
memory), heap_rss_kb (the [heap] mapping: glibc's one arena) and
stacks_rss_kb (anonymous mappings the size of a thread's stack, 8 MiB:
the threads' stacks; glibc maps the guard page apart).

rss_kb is the mean of RSS read every RSS_READ_PERIOD_S over the last
RSS_WINDOW_S, not one read a second: RSS is a sawtooth with the server's heap
trims (server/malloc_tuning.h, kHeapTrimPeriod). When they came every 2 s
(read at 20 Hz under soak_load: 42 MB after a trim, 48-63 MB before the
next), one read a second fell on alternate phases of it, and the phase
drifted as the trimmer's period ran a little over 2 s: in the 2-minute run
that failed at 1.083 (2026-11-26 run 3) even seconds read 5-10 MB above odd
ones in the first minute and 0-3 MB below them in the second (RSS's
autocorrelation at lag 2: 0.60, at lag 1: 0.18), so the fifths' medians
judged the sampler's phase. A mean over a whole number of trim periods sees
every phase alike. --once (the after-traffic check) reads once.
"""
import os
import subprocess
import sys
import time
import urllib.request

HEADER = ("time_s,phase,rss_kb,fds,threads,queue_depth,heap_in_use_kb,heap_free_kb,"
          "grpc_timer_threads,gpu_mem_mib,rss_now_kb,rss_anon_kb,rss_file_kb,rss_shmem_kb,"
          "heap_rss_kb,stacks_rss_kb")
# rss_kb's window: a whole number of the server's heap trim periods (0.5 s;
# see above), and how often RSS is read within it.
RSS_WINDOW_S = 2.0
RSS_READ_PERIOD_S = 0.1
METRICS = ("nv_inference_pending_request_count", "attnserve_heap_in_use_bytes",
           "attnserve_heap_free_bytes")
# /proc/PID/task/*/comm holds the first 15 bytes of a thread's name.
GRPC_TIMER_COMM = "grpc_global_timer"[:15]


def status_field(pid, name):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    return -1


# A thread's stack mapping (glibc's default 8 MiB; its guard page is a
# mapping of its own).
STACK_MAPPING_BYTES = 8 << 20


def mapping_rss(pid):
    """(heap_rss_kb, stacks_rss_kb) from /proc/PID/smaps."""
    heap = stacks = 0
    kind = None
    with open("/proc/%d/smaps" % pid) as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):
                start, end = (int(x, 16) for x in first.split("-"))
                fields = line.split()
                kind = ("heap" if fields[-1] == "[heap]" else
                        "stack" if len(fields) == 5 and end - start == STACK_MAPPING_BYTES
                        else None)
            elif first == "Rss:" and kind is not None:
                if kind == "heap":
                    heap += int(line.split()[1])
                else:
                    stacks += int(line.split()[1])
    return heap, stacks


def scrape(url):
    """The METRICS values at url ("" each when the scrape fails)."""
    values = dict.fromkeys(METRICS, "")
    try:
        text = urllib.request.urlopen(url, timeout=0.8).read().decode()
    except OSError:
        return values
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in values:
            values[name] = line.split()[-1]
    return values


def kb(text):
    return "" if text == "" else "%d" % (int(float(text)) // 1024)


def timer_threads(pid):
    n = 0
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/comm" % (pid, tid)) as f:
                n += f.read().strip() == GRPC_TIMER_COMM
        except OSError:
            pass  # the thread ended meanwhile
    return n


def gpu_memory_mib():
    gpu = os.environ.get("ATTNSERVE_SOAK_GPU", "")
    if gpu == "":
        return ""
    try:
        out = subprocess.run(["nvidia-smi", "-i", gpu, "--query-gpu=memory.used",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=5).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out if out.isdigit() else ""


def row(pid, url, phase, rss_reads=()):
    """One CSV row; rss_kb is the mean of rss_reads and this instant's read."""
    m = scrape(url)
    rss_now = status_field(pid, "VmRSS")
    reads = list(rss_reads) + [rss_now]
    heap_rss, stacks_rss = mapping_rss(pid)
    return "%.3f,%s,%d,%d,%d,%s,%s,%s,%d,%s,%d,%d,%d,%d,%d,%d" % (
        time.time(), phase, sum(reads) // len(reads), len(os.listdir("/proc/%d/fd" % pid)),
        status_field(pid, "Threads"), m["nv_inference_pending_request_count"],
        kb(m["attnserve_heap_in_use_bytes"]), kb(m["attnserve_heap_free_bytes"]),
        timer_threads(pid), gpu_memory_mib(), rss_now, status_field(pid, "RssAnon"),
        status_field(pid, "RssFile"), status_field(pid, "RssShmem"), heap_rss, stacks_rss)


def loop(pid, url, path, phase_file):
    next_tick = time.time()
    reads = []  # (time, RSS) over the last RSS_WINDOW_S
    while os.path.exists(phase_file):
        try:
            with open(phase_file) as f:
                phase = f.read().strip() or "after"
            line = row(pid, url, phase, [r for _, r in reads])
        except OSError:
            break  # the process or the phase file is gone
        with open(path, "a") as f:
            f.write(line + "\n")
        next_tick += 1.0
        # Read RSS until the next row is due, on the clock like the rows.
        next_read = time.time()
        while True:
            now = time.time()
            if now >= next_tick:
                break
            if now >= next_read:
                try:
                    reads.append((now, status_field(pid, "VmRSS")))
                except OSError:
                    break
                next_read += RSS_READ_PERIOD_S
            time.sleep(max(0.0, min(next_read, next_tick) - time.time()))
        reads = [(t, r) for t, r in reads if t > next_tick - RSS_WINDOW_S]


def main(argv):
    if argv[1:] == ["--header"]:
        print(HEADER)
    elif len(argv) == 5 and argv[1] == "--once":
        print(row(int(argv[2]), argv[3], argv[4]))
    elif len(argv) == 5:
        loop(int(argv[1]), argv[2], argv[3], argv[4])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
