#!/usr/bin/env python3
"""scripts/plot-load.py's series: rows that differ only in their protocol (or shared
memory kind) are separate curves, not one line zig-zagging between them (issue 27
finding 15); files written before those columns existed read as native, no shm.
Runs with the system Python (the script's grouping needs only the standard library)."""
import csv
import importlib.util
import os
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("plot_load",
                                              os.path.join(ROOT, "scripts", "plot-load.py"))
plot_load = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_load)

# The columns `attnctl load --csv` writes (client/cli/load_report.cc), old ones first.
OLD_COLUMNS = ["label", "mode", "concurrency", "rate", "channels", "stream", "layout", "dtype",
               "batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim", "options",
               "seconds", "requests", "errors", "req_per_s", "p50_ms", "p99_ms"]
COLUMNS = OLD_COLUMNS + ["protocol", "shm"]


def row(concurrency, req_per_s, protocol=None, shm=None):
    r = {"label": "", "mode": "closed", "concurrency": str(concurrency), "rate": "0",
         "channels": "1", "stream": "false", "layout": "dense", "dtype": "fp16", "batch": "1",
         "seqlen_q": "128", "seqlen_k": "128", "heads_q": "8", "heads_kv": "8",
         "head_dim": "64", "options": "causal", "seconds": "5", "requests": "100",
         "errors": "0", "req_per_s": str(req_per_s), "p50_ms": "1.0", "p99_ms": "2.0"}
    if protocol is not None:
        r["protocol"] = protocol
        r["shm"] = shm
    return r


class PlotLoadSeriesTest(unittest.TestCase):
    def write(self, columns, rows):
        f = tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False, newline="")
        self.addCleanup(os.unlink, f.name)
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow(r)
        f.close()
        return f.name

    def test_protocols_and_shm_kinds_are_separate_series(self):
        # One sweep over concurrency 1 and 4 per transport, interleaved as a CSV
        # that collects several runs is.
        rows = []
        for c in (1, 4):
            rows.append(row(c, 100 * c, "native", "none"))
            rows.append(row(c, 90 * c, "v2", "none"))
            rows.append(row(c, 95 * c, "v2", "system"))
        series = plot_load.load_series([self.write(COLUMNS, rows)])
        self.assertEqual(len(series), 3, list(series))
        by_transport = {}
        for key, members in series.items():
            kinds = {(r["protocol"], r["shm"]) for r in members}
            self.assertEqual(len(kinds), 1, "series {!r} mixes {}".format(key, sorted(kinds)))
            self.assertEqual(sorted(r["concurrency"] for r in members), ["1", "4"])
            by_transport[kinds.pop()] = key
        self.assertEqual(set(by_transport),
                         {("native", "none"), ("v2", "none"), ("v2", "system")})
        # Each curve's legend says which it is.
        self.assertIn("native", by_transport[("native", "none")])
        self.assertIn("v2", by_transport[("v2", "none")])
        self.assertIn("shm=system", by_transport[("v2", "system")])

    def test_files_without_the_protocol_columns_are_native(self):
        old = self.write(OLD_COLUMNS, [row(1, 100), row(4, 400)])
        new = self.write(COLUMNS, [row(1, 100, "native", "none"), row(4, 400, "native", "none")])
        old_series = plot_load.load_series([old])
        self.assertEqual(len(old_series), 1)
        (old_key,) = old_series
        (new_key,) = plot_load.load_series([new])
        # The same series apart from the file name each key starts with.
        self.assertEqual(old_key.replace(os.path.basename(old), "FILE"),
                         new_key.replace(os.path.basename(new), "FILE"))


if __name__ == "__main__":
    unittest.main()
