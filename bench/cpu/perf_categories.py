#!/usr/bin/env python3
"""Server CPU samples of a `perf record -g` file by category (thread hand-offs, the CPU
kernel, gRPC, protobuf, malloc, copies, attnserve parts), from `perf report --sort dso,sym`:
the breakdown bench/cpu/kv_step_overhead.sh PERF=1 runs feed NOTES-serving.md.
Usage: bench/cpu/perf_categories.py FILE.perf.data"""
import re, subprocess, sys, collections
def classify(dso, sym):
    s = sym
    if "cpu::" in s or "CpuBackend" in s or "RunTasks" in s: return "CPU attention kernel + its task pool"
    if dso == "[kernel.kallsyms]":
        if re.search(r"finish_task_switch|__schedule|schedule|futex|try_to_wake|wake_up|_raw_spin_unlock|rseq|exit_to_user|pick_next|dequeue|enqueue|update_curr|select_task", s):
            return "scheduler: thread hand-offs (futex wake/wait, context switches)"
        if re.search(r"tcp|ip_|sock|skb|net_|dev_|epoll|ep_|sys_sendmsg|sys_recvmsg|inet|loopback|napi|softirq|__x64_sys_(send|recv)|syscall|entry_SYSCALL", s):
            return "kernel: TCP loopback, epoll, syscalls"
        return "kernel: other"
    if dso.startswith("libgrpc") or dso.startswith("libgpr") or dso.startswith("libaddress_sorting") or dso.startswith("libupb") or dso.startswith("libre2"): return "gRPC (transport, HTTP/2, call objects)"
    if dso.startswith("libprotobuf"): return "protobuf (parse, serialize)"
    if re.search(r"malloc|free|_int_|operator new|operator delete|tcache|consolidate", s): return "malloc/free"
    if re.search(r"memmove|memcpy|memset", s): return "memcpy/memset"
    if dso.startswith("libabsl") or "absl::" in s: return "absl (mutex, time, status)"
    if dso == "attnserve":
        if re.search(r"Executor|FairQueue|WorkItem|Queued|Dispatch", s): return "attnserve: executor"
        if re.search(r"Kv|Paged|Reserve|Page", s): return "attnserve: K/V front-end, pool, cache"
        return "attnserve: other (front-end, validation, reactors)"
    return "other libs (libc, libstdc++)"
tot = collections.Counter()
out = subprocess.run(["perf", "report", "-i", sys.argv[1], "--no-children", "--sort", "dso,sym", "-g", "none",
                      "--percent-limit", "0"], capture_output=True, text=True).stdout
for line in out.splitlines():
    m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[[.k]\]\s+(.*)", line)
    if m: tot[classify(m.group(2), m.group(3))] += float(m.group(1))
for k, v in tot.most_common(): print(f"{v:6.1f}%  {k}")
