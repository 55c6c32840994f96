#!/usr/bin/env python3
"""scripts/soak.sh's sampler: once a second (on the clock, so slow reads do not
stretch the interval) appends one CSV row of a process's state until
PHASE_FILE is removed. One long-lived process, because a process per sample
takes longer than the interval on a loaded 2-core machine.

    soak_sample.py PID METRICS_URL CSV PHASE_FILE   the loop
    soak_sample.py --once PID METRICS_URL PHASE     prints one row (no header)
    soak_sample.py --header                         prints the CSV header

Columns (HEADER): time_s, phase; rss_kb, fds, threads from /proc; queue_depth
(nv_inference_pending_request_count), heap_in_use_kb and heap_free_kb (the
allocator's account: attnserve_heap_in_use_bytes, attnserve_heap_free_bytes)
from METRICS_URL; grpc_timer_threads: threads named grpc_global_timer, gRPC's
timer pool, which gRPC grows when all its timer threads are busy and never
shrinks before shutdown (tests/soak/README.md); gpu_mem_mib: memory used on
GPU $ATTNSERVE_SOAK_GPU (nvidia-smi; empty when that is unset), for a server
with the CUDA backend and the GPU to itself.
"""
import os
import subprocess
import sys
import time
import urllib.request

HEADER = ("time_s,phase,rss_kb,fds,threads,queue_depth,heap_in_use_kb,heap_free_kb,"
          "grpc_timer_threads,gpu_mem_mib")
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


def row(pid, url, phase):
    m = scrape(url)
    return "%.3f,%s,%d,%d,%d,%s,%s,%s,%d,%s" % (
        time.time(), phase, status_field(pid, "VmRSS"), len(os.listdir("/proc/%d/fd" % pid)),
        status_field(pid, "Threads"), m["nv_inference_pending_request_count"],
        kb(m["attnserve_heap_in_use_bytes"]), kb(m["attnserve_heap_free_bytes"]),
        timer_threads(pid), gpu_memory_mib())


def loop(pid, url, path, phase_file):
    next_tick = time.time()
    while os.path.exists(phase_file):
        try:
            with open(phase_file) as f:
                phase = f.read().strip() or "after"
            line = row(pid, url, phase)
        except OSError:
            break  # the process or the phase file is gone
        with open(path, "a") as f:
            f.write(line + "\n")
        next_tick += 1.0
        time.sleep(max(0.0, next_tick - time.time()))


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
