#!/usr/bin/env python3
"""scripts/soak.sh's sampler: once a second (on the clock, so slow reads do not
stretch the interval) appends one CSV row of a process's state until
PHASE_FILE is removed: time_s, phase (PHASE_FILE's contents), rss_kb, fds,
threads, queue_depth (nv_inference_pending_request_count at METRICS_URL).
One long-lived process, because a process per sample takes longer than the
interval on a loaded 2-core machine.

    soak_sample.py PID METRICS_URL CSV PHASE_FILE
"""
import os
import sys
import time
import urllib.request


def status_field(pid, name):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    return -1


def queue_depth(url):
    try:
        text = urllib.request.urlopen(url, timeout=0.8).read().decode()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("nv_inference_pending_request_count"):
            return line.split()[-1]
    return ""


def main():
    pid, url, path, phase_file = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    next_tick = time.time()
    while os.path.exists(phase_file):
        try:
            with open(phase_file) as f:
                phase = f.read().strip() or "after"
            row = "%.3f,%s,%d,%d,%d,%s\n" % (
                time.time(), phase, status_field(pid, "VmRSS"),
                len(os.listdir("/proc/%d/fd" % pid)), status_field(pid, "Threads"),
                queue_depth(url))
        except OSError:
            break  # the process or the phase file is gone
        with open(path, "a") as f:
            f.write(row)
        next_tick += 1.0
        time.sleep(max(0.0, next_tick - time.time()))


if __name__ == "__main__":
    main()
