#!/usr/bin/env python3
"""Times cuDNN's FP8 forward SDPA (the SDPA_FP8 graph node, through the
nvidia-cudnn-frontend Python package) on the prefill anchor shapes, the same
way attn_bench and sdpa_bench.py time theirs: CUDA events, L2 flushed (256 MB
write) before each run, 5 warm-ups, median of 25 runs, random inputs.

Inputs: Q, K, V as E4M3 codes of N(0, 1) samples, stored [B, S, H, D] (as the
service stores them) and described to cuDNN as [B, H, S, D] strided views;
descale_q/k/v = 1 (as attn_bench's fp8 rows: the codes with descale 1),
scale_s = 448 / descale_s = 1/448 (P in [0, 1] spread over E4M3's range),
scale_o = 1. O is E4M3 (--o_dtype=fp8, what Hopper's FP8 engines take) or
BF16 (--o_dtype=bf16, tried; skipped with cuDNN's reason when refused).

CSV rows use sdpa_bench.py's columns; dtype is written as bf16 and hq = hkv =
2048 / D, b = 16384 / N, so each row keys like attn_bench's fp8/fp8_dequant rows
(which run the BF16 grid's shapes on FP8 codes). impl = cudnn_fp8 (FP8 O) or
cudnn_fp8_obf16. tflops = 4 B H N N D / ms, halved when causal (the same rule
as sdpa_bench.py and attn_bench). Before timing, one small shape is checked
against a float64 reference on the dequantised inputs; a failure still times
the grid (one GPU call) but prints FAIL and exits 1.

  --compare FILE...   prints attn_bench fp8 rows beside cudnn_fp8 rows from
                      the given CSVs (no GPU needed) and exits.
Exits 0 with a 'skipped:' line on stderr when there is no CUDA GPU, no
frontend, or no FP8 SDPA engine for this GPU (cuDNN's FP8 SDPA needs sm_90+)."""
import argparse
import csv
import glob
import math
import os
import sys

E4M3_MAX = 448.0


def skip(why):
    print(f"skipped: cudnn_fp8_sdpa: {why}", file=sys.stderr)
    sys.exit(0)


def shapes(ds, ns):
    out = []
    for d in ds:
        for n in ns:
            for c in (False, True):
                out.append((d, 16384 // n, 2048 // d, n, c))
    return out


def find_torch_cudnn():
    """The libcudnn.so.9 torch loaded (or ships): the frontend must bind the same one."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split()[-1]
                if "/libcudnn.so" in p and os.path.exists(p):
                    return p
    except OSError:
        pass
    import torch
    base = os.path.dirname(os.path.dirname(torch.__file__))
    hits = sorted(glob.glob(os.path.join(base, "nvidia", "**", "libcudnn.so.9*"), recursive=True))
    return hits[0] if hits else ""


def import_frontend():
    """Imports torch and cudnn with the frontend pointed at torch's libcudnn:
    it tries LD_LIBRARY_PATH's directories (read from os.environ at import)
    before its own site-packages and the plain name."""
    try:
        import torch
    except ImportError as e:
        skip(f"no torch ({e})")
    if not torch.cuda.is_available():
        skip("no CUDA GPU")
    lib = find_torch_cudnn()
    if lib:
        d = os.path.dirname(lib)
        rest = os.environ.get("LD_LIBRARY_PATH", "")
        os.environ["LD_LIBRARY_PATH"] = d + (":" + rest if rest else "")
    try:
        import cudnn
    except Exception as e:  # ImportError, or the backend library failing to load
        skip(f"nvidia-cudnn-frontend not importable ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
             "install the carried wheel (scripts/device/cudnn-fp8-bench.sh)")
    return torch, cudnn, lib


class Fp8Sdpa:
    """One built SDPA_FP8 graph for a shape, with its device tensors."""

    def __init__(self, torch, cudnn, handle, b, h, n, d, causal, o_dtype):
        dev = "cuda"
        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        # [B, S, H, D] storage, [B, H, S, D] view.
        mk = lambda: torch.randn(b, n, h, d, device=dev).to(torch.float8_e4m3fn).transpose(1, 2)
        self.q, self.k, self.v = mk(), mk(), mk()
        odt = torch.float8_e4m3fn if o_dtype == "fp8" else torch.bfloat16
        self.o = torch.empty(b, n, h, d, device=dev, dtype=odt).transpose(1, 2)
        scalar = lambda x: torch.full((1, 1, 1, 1), x, device=dev, dtype=torch.float32)
        self.scales = {"descale_q": scalar(1.0), "descale_k": scalar(1.0), "descale_v": scalar(1.0),
                       "descale_s": scalar(1.0 / E4M3_MAX), "scale_s": scalar(E4M3_MAX), "scale_o": scalar(1.0)}
        self.amax_s, self.amax_o = scalar(0.0), scalar(0.0)
        g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        desc = lambda name, t: g.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=e4m3)
        tq, tk, tv = desc("q", self.q), desc("k", self.k), desc("v", self.v)
        ts = {name: g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32) for name in self.scales}
        to, _, tas, tao = g.sdpa_fp8(q=tq, k=tk, v=tv, **ts, is_inference=True, attn_scale=1.0 / math.sqrt(d),
                                     use_causal_mask=causal, name="sdpa_fp8")
        to.set_output(True).set_dim(list(self.o.shape)).set_stride(list(self.o.stride())).set_data_type(
            e4m3 if o_dtype == "fp8" else cudnn.data_type.BFLOAT16)
        for t in (tas, tao):
            t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.ws = torch.empty(max(1, g.get_workspace_size()), device=dev, dtype=torch.uint8)
        self.pack = {tq: self.q, tk: self.k, tv: self.v, to: self.o, tas: self.amax_s, tao: self.amax_o}
        self.pack.update({ts[name]: t for name, t in self.scales.items()})
        self.g, self.handle = g, handle

    def run(self):
        self.g.execute(self.pack, self.ws, handle=self.handle)

    def bytes_held(self):
        t = (self.q, self.k, self.v, self.o, self.ws)
        return sum(x.numel() * x.element_size() for x in t)


def check(torch, cudnn, handle, o_dtype, break_ref):
    """cuDNN's output at one small shape against float64 attention over the
    dequantised codes. Tolerance: relative Frobenius error <= 0.08 and max
    |err| <= 0.1 + 0.125 |ref|: E4M3 has 3 mantissa bits (half an ulp is 1/16
    relative) and P is quantised to E4M3 before P V, as is O with --o_dtype=fp8."""
    ok = True
    for causal in (False, True):
        b, h, n, d = 2, 2, 256, 128
        s = Fp8Sdpa(torch, cudnn, handle, b, h, n, d, causal, o_dtype)
        s.run()
        torch.cuda.synchronize()
        q, k, v = (x.to(torch.float64) for x in (s.q, s.k, s.v))
        sc = q @ k.transpose(-1, -2) / math.sqrt(d)
        if causal != break_ref:  # --break_check flips the reference's mask: the check must fail
            sc = sc.masked_fill(torch.ones(n, n, dtype=torch.bool, device=sc.device).triu(1), float("-inf"))
        ref = torch.softmax(sc, dim=-1) @ v
        o = s.o.to(torch.float64)
        err = (o - ref).abs()
        rel = (torch.linalg.vector_norm(o - ref) / torch.linalg.vector_norm(ref)).item()
        bad = int((err > 0.1 + 0.125 * ref.abs()).sum().item())
        good = rel <= 0.08 and bad == 0
        print(f"check d={d} n={n} causal={int(causal)} o={o_dtype}: rel_fro={rel:.4f} max_abs={err.max().item():.4f} "
              f"outside={bad} (amax_s {s.amax_s.item():.4g}, amax_o {s.amax_o.item():.4g}, "
              f"ref max {ref.abs().max().item():.4g}) -> {'ok' if good else 'FAIL'}", file=sys.stderr)
        ok = ok and good
    return ok


def compare(paths):
    rows = {}
    for p in paths:
        with open(p) as f:
            for r in csv.DictReader(line for line in f if not line.startswith("#")):
                if r.get("kind") == "prefill":
                    rows.setdefault((int(r["d"]), int(r["sk"]), r["causal"]), {})[r["impl"]] = r
    print(f"{'d':>4} {'n':>6} {'causal':>6} {'fp8 (ours)':>11} {'cudnn_fp8':>10} {'ratio':>6}")
    for (d, n, c), by in sorted(rows.items()):
        ours = float(by["fp8"]["tflops"]) if "fp8" in by else float("nan")
        peer = by.get("cudnn_fp8") or by.get("cudnn_fp8_obf16")
        cu = float(peer["tflops"]) if peer else float("nan")
        print(f"{d:>4} {n:>6} {c:>6} {ours:>11.1f} {cu:>10.1f} {ours / cu if cu == cu and cu else float('nan'):>6.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", default="128", help="head dims, comma-separated (default 128; 64,256 tried if given)")
    ap.add_argument("--n", default="1024,2048,4096,8192,16384", help="sequence lengths (Sq = Sk), comma-separated")
    ap.add_argument("--o_dtype", default="fp8", help="O's type: fp8, bf16 or fp8,bf16 (default fp8)")
    ap.add_argument("--csv", default="-", help="CSV output file (default stdout)")
    ap.add_argument("--runs", type=int, default=25, help="timed runs after 5 warm-ups (median reported)")
    ap.add_argument("--no_check", action="store_true", help="skip the float64 check")
    ap.add_argument("--break_check", action="store_true", help="flip the reference's mask (the check must fail)")
    ap.add_argument("--compare", nargs="+", metavar="CSV", help="print fp8 vs cudnn_fp8 from CSVs and exit")
    a = ap.parse_args()
    if a.compare:
        compare(a.compare)
        return 0
    try:
        ds = [int(x) for x in a.d.split(",")]
        ns = [int(x) for x in a.n.split(",")]
    except ValueError:
        ap.error(f"--d and --n take comma-separated integers, got --d={a.d} --n={a.n}")
    odts = a.o_dtype.split(",")
    if any(x not in ("fp8", "bf16") for x in odts):
        ap.error(f"--o_dtype: expected fp8 and/or bf16, got {a.o_dtype}")
    if any(n <= 0 or 16384 % n for n in ns) or any(d <= 0 or 2048 % d for d in ds):
        ap.error("--n must divide 16384 and --d must divide 2048 (b = 16384 / N, heads = 2048 / D)")

    torch, cudnn, lib = import_frontend()
    cap = torch.cuda.get_device_capability()
    print(f"# cudnn frontend {getattr(cudnn, '__version__', '?')}, backend {cudnn.backend_version()} "
          f"(libcudnn: {lib or 'found by the frontend'}); torch {torch.__version__} cudnn "
          f"{torch.backends.cudnn.version()}; {torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}", file=sys.stderr)
    if cap[0] < 9:
        skip(f"cuDNN's FP8 SDPA needs sm_90 or newer, this GPU is sm_{cap[0]}{cap[1]}")
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)

    if not a.no_check:
        try:
            ok = check(torch, cudnn, handle, odts[0], a.break_check)
        except Exception as e:
            skip(f"no FP8 SDPA engine for o={odts[0]} here ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    else:
        ok = True

    f = sys.stdout if a.csv == "-" else open(a.csv, "w")
    f.write("kind,dtype,d,b,hq,hkv,sq,sk,causal,impl,ms,tflops,tbps,peak_mem_bytes\n")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for d, b, h, n, causal in shapes(ds, ns):
        for odt in odts:
            name = "cudnn_fp8" if odt == "fp8" else "cudnn_fp8_obf16"
            try:
                s = Fp8Sdpa(torch, cudnn, handle, b, h, n, d, causal, odt)
                times = []
                for it in range(5 + a.runs):
                    flush.fill_(it & 0xFF)
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    s.run()
                    e1.record()
                    e1.synchronize()
                    if it >= 5:
                        times.append(e0.elapsed_time(e1))
            except Exception as e:
                print(f"skip {name} prefill d={d} n={n} causal={int(causal)}: "
                      f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}", file=sys.stderr)
                continue
            times.sort()
            ms = times[len(times) // 2]
            flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
            nbytes = 3.0 * s.q.numel() + s.o.numel() * s.o.element_size()
            f.write(f"prefill,bf16,{d},{b},{h},{h},{n},{n},{int(causal)},{name},{ms:.4f},"
                    f"{flops / ms * 1e-9:.2f},{nbytes / ms * 1e-9:.3f},{s.bytes_held()}\n")
            f.flush()
            del s
            torch.cuda.empty_cache()
    if not ok:  # the rows are still written (one device call), but the run fails
        print("FAIL: cudnn_fp8_sdpa: cuDNN FP8 SDPA output outside the FP8 tolerance (see the check lines)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
