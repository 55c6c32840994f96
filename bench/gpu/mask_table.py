#!/usr/bin/env python3
"""Merges mask_bench's CSV (ours) with mask_peers.py's (FlexAttention, SDPA
with attn_mask) into one table: each of our rows with the peer of the same
shape and its speed ratio (peer ms / our ms, > 1 = we are faster)."""
import argparse
import csv
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ours")
    ap.add_argument("peers")
    ap.add_argument("--out", required=True, help="merged CSV (header lines from --header are kept)")
    ap.add_argument("--header", help="a file of '# ...' lines to put first")
    args = ap.parse_args()
    ours = list(csv.DictReader(open(args.ours)))
    peers = list(csv.DictReader(open(args.peers))) if args.peers else []

    def peer_ms(r):
        for p in peers:
            same = (p["d"], p["b"], p["h"], p["n"]) == (r["d"], r["b"], r["h"], r["n"])
            if not same:
                continue
            if r["grid"] == "sparse" and p["peer"] == "flex" and p["pattern"] == r["pattern"] and abs(float(p["s"]) - float(r["s"])) < 1e-6:
                return "flex", float(p["ms"])
            if r["grid"] == "bias" and p["peer"] == "sdpa_best" and p["mods"] == r["mods"]:
                return "sdpa_" + p["note"], float(p["ms"])
        return "", None

    cols = list(ours[0].keys()) + ["peer", "peer_ms", "speedup_vs_peer"] if ours else []
    with open(args.out, "w", newline="") as f:
        if args.header:
            f.write(open(args.header).read())
        w = csv.writer(f)
        w.writerow(cols)
        print(f"{'grid':7} {'pattern':8} {'mods':12} {'d':>4} {'n':>6} {'s':>5} {'kept':>6} {'impl':8} {'kernel':8} "
              f"{'ms':>8} {'plain':>8} {'bound':>6} {'bias TB/s':>9} {'peer':>14} {'peer ms':>8} {'x peer':>6}")
        for r in ours:
            name, ms = peer_ms(r)
            speed = ms / float(r["ms"]) if ms else None
            w.writerow([r[c] for c in ours[0].keys()] + [name, f"{ms:.4f}" if ms else "", f"{speed:.3f}" if speed else ""])
            print(f"{r['grid']:7} {r['pattern']:8} {r['mods']:12} {r['d']:>4} {r['n']:>6} {r['s']:>5} {r['kept']:>6} {r['impl']:8} "
                  f"{r['kernel']:8} {float(r['ms']):8.3f} {float(r['plain_ms']):8.3f} {r['bound_ratio']:>6} {r['bias_tbps']:>9} "
                  f"{name:>14} {ms if ms else float('nan'):8.3f} {speed if speed else float('nan'):6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
