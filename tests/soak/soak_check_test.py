#!/usr/bin/env python3
"""scripts/soak_check.py's growth rule on made-up CSVs: a flat run passes, and
each kind of growth it exists to catch fails (an RSS leak, a queue that keeps
requests), while queue depth's sample-to-sample scatter does not; and the
memory rule: RSS within the budget plus the stated constant passes, one
sample over it fails; and the rest rule: a server back to its heap in use and
anonymous RSS before the traffic passes, one holding more fails."""
import contextlib
import io
import os
import random
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import soak_check  # noqa: E402
import soak_sample  # noqa: E402

CONCURRENCY = 5


def write_csv(rows):
    """rows: dicts of column -> value, one a second; returns the CSV's path."""
    header = soak_sample.HEADER.split(",")
    f = tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False)
    with f:
        f.write(soak_sample.HEADER + "\n")
        for i, row in enumerate(rows):
            values = {"time_s": str(i), "phase": "traffic", "rss_kb": "50000", "fds": "13",
                      "threads": "24", "queue_depth": "3", "heap_in_use_kb": "11000",
                      "heap_free_kb": "20000", "grpc_timer_threads": "3", "gpu_mem_mib": "",
                      "rss_now_kb": "50000", "rss_anon_kb": "30000", "rss_file_kb": "20000",
                      "rss_shmem_kb": "0", "heap_rss_kb": "25000", "stacks_rss_kb": "700"}
            values.update({k: str(v) for k, v in row.items()})
            f.write(",".join(values[k] for k in header) + "\n")
    return f.name


def row(values):
    """One row of soak_sample.py --once (no header) with these values."""
    path = write_csv([values])
    try:
        with open(path) as f:
            return f.read().splitlines()[1]
    finally:
        os.unlink(path)


def run_budget(rows, budget_bytes):
    path = write_csv(rows)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return soak_check.budget(path, budget_bytes)
    finally:
        os.unlink(path)


def run(rows):
    path = write_csv(rows)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return soak_check.check(path, CONCURRENCY)
    finally:
        os.unlink(path)


class SoakCheckTest(unittest.TestCase):
    def setUp(self):
        self.rng = random.Random(15)

    def scattered_queue(self, n):
        # Like the runs on the loaded 2-core machine: 0 to 12, median ~3.
        return [min(12, int(self.rng.expovariate(1 / 3.3))) for _ in range(n)]

    def test_flat_run_passes(self):
        self.assertEqual(run([{"queue_depth": q} for q in self.scattered_queue(120)]), 0)

    def test_queue_scatter_that_tipped_the_median_rule_passes(self):
        # 3.0 -> 5.5 in the medians (the 2026-11-26 pool run 3), no trend.
        queue = [3] * 24 + [3] * 24 + [5, 6] * 12 + [1, 2] * 12 + [5, 6] * 12
        self.assertEqual(run([{"queue_depth": q} for q in queue]), 0)

    def test_queue_that_keeps_requests_fails(self):
        # One request stays queued every 15 s on top of the scatter.
        queue = [q + i // 15 for i, q in enumerate(self.scattered_queue(120))]
        self.assertEqual(run([{"queue_depth": q} for q in queue]), 1)

    def test_rss_leak_fails(self):
        # 50 MB growing by 250 KB a second: 1.31x between the compared fifths.
        self.assertEqual(run([{"rss_kb": 50000 + 250 * i} for i in range(120)]), 1)

    def test_rss_of_bytes_in_flight_passes(self):
        # The fifths' medians 1.18x apart (a healthy run with the hostile
        # clients: RSS mostly bytes in flight, back at rest after the traffic).
        rss = [66000] * 24 + [69630] * 24 + [72000] * 24 + [76000] * 24 + [81886] * 24
        self.assertEqual(run([{"rss_kb": v} for v in rss]), 0)

    def test_server_back_to_rest_passes(self):
        before = row({"heap_in_use_kb": 1500, "rss_anon_kb": 6000})
        after = row({"heap_in_use_kb": 1500 + 4096, "rss_anon_kb": 6000 + 16384})
        self.assertEqual(soak_check.rest(before, after), 0)

    def test_heap_held_after_the_traffic_fails(self):
        # 32 B kept per call over 2 minutes of soak_load's ~600 calls a second.
        before = row({"heap_in_use_kb": 1500, "rss_anon_kb": 6000})
        after = row({"heap_in_use_kb": 1500 + 4097, "rss_anon_kb": 6000 + 4097})
        self.assertEqual(soak_check.rest(before, after), 1)

    def test_anonymous_memory_held_after_the_traffic_fails(self):
        # Memory outside the heap (thread stacks, mappings) kept, heap in use back.
        before = row({"heap_in_use_kb": 1500, "rss_anon_kb": 6000})
        after = row({"heap_in_use_kb": 1500, "rss_anon_kb": 6000 + 16385})
        self.assertEqual(soak_check.rest(before, after), 1)

    def test_heap_not_read_fails(self):
        before = row({"heap_in_use_kb": 1500})
        after = row({"heap_in_use_kb": ""})
        self.assertEqual(soak_check.rest(before, after), 1)

    def test_thread_leak_fails(self):
        self.assertEqual(run([{"threads": 24 + i // 10} for i in range(120)]), 1)

    def test_rss_within_budget_passes(self):
        budget = 256 << 20
        limit_kb = (budget + soak_check.BUDGET_SLACK_BYTES) // 1024
        self.assertEqual(run_budget([{"rss_now_kb": limit_kb} for _ in range(60)], budget), 0)

    def test_rss_over_budget_once_fails(self):
        budget = 256 << 20
        limit_kb = (budget + soak_check.BUDGET_SLACK_BYTES) // 1024
        rows = [{} for _ in range(60)]
        rows[37] = {"rss_now_kb": limit_kb + 1}  # one instant over, the mean below
        self.assertEqual(run_budget(rows, budget), 1)


if __name__ == "__main__":
    unittest.main()
