#!/usr/bin/env python3
"""Benchmarks the Python client (bench/NOTES-python.md's targets) on one server, writing CSV rows.

(a) client throughput: the Python client (NumPy BF16 inputs) beside `attnctl
    load` on the same server, for small (B=1, N=256, H=16, D=128) and large
    (B=4, N=4096) requests at concurrency 1 and 16, in each form (--forms):
      unary         Client.forward() from N threads;
      stream        one ForwardStream, N requests in flight (N threads);
      async         AsyncClient.forward(), N coroutines on one event loop;
      async_stream  one AsyncForwardStream, N coroutines each awaiting its own.
    (default: unary and stream, as scripts/device/gpu-python.sh's budget allows.)
    Every form once per transport of the tensor-carrying calls (--transports,
    attnserve._transport: "native" is gRPC C++ through attnserve._native,
    "grpcio" grpcio; the `transport` column). ratio = Python req/s over
    attnctl's (the target is >= 0.9). client_cpu_ms: the client process's CPU
    (user + system, all threads) over the window per request, attnctl's too.
    --rpcs=forward,echo adds the Echo RPC (validated, q's bytes back, no
    compute: the transport and client cost alone; unary forms only: Echo has
    no stream). "mid" (B=4, N=512) is a size the CPU backend's Forward can do
    (scripts/device/gpu-python.sh --cpu).
(b) transformers generate(): tokens/s with local SDPA, with the stateless
    "attnserve" attention and with K/V on the server (attnserve.hf_cache), for
    the small test Llama and a ~1.1B-parameter Llama config (random weights,
    BF16), batch 1 and 32. Where the time goes: the seconds spent inside
    attnserve calls (client side), the server's total and compute time of those
    calls (ServerTiming), and the rest (the model's own layers, in this process).

Usage (GPU machine; one command):
  python3 bench/gpu/python_bench.py --server .device-carry/bin/attnserve \\
      --attnctl .device-carry/bin/attnctl --csv bench/results/python-h100-2026-11-23.csv
  ... --quick             a few seconds per point, fewer tokens (smoke run)
  ... --seconds 2,6 --concurrency 1,16 --prompt 128 --new-tokens 128   (the defaults' knobs)
  ... --target HOST:PORT  use a running server instead of starting one
  ... --parts client      or "generate": only one part
  ... --label before      written to the rows' notes column (runs of two client
                          versions, one PYTHONPATH each, into one CSV)

Needs on its PYTHONPATH: the attnserve package (a wheel built here:
`.venv/bin/python -m pip wheel --no-deps -w WHEELS ./python`) and protobuf
7.x / grpcio-health-checking wheels, installed with `pip install --no-deps
--no-index --target .pylib WHEELS/*.whl` as bench/baselines/gpu_check.sh does;
torch and transformers from the machine. The started server runs
--backend=cuda with its defaults (K/V budget: --kv_cache_bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import ml_dtypes
import numpy as np

import attnserve
from attnserve import AsyncClient, Client, _request, _transport

FIELDS = ["part", "scenario", "rpc", "impl", "model", "dtype", "batch", "seqlen", "heads_q", "heads_kv",
          "head_dim", "concurrency", "new_tokens", "seconds", "requests", "req_per_s",
          "tokens_per_s", "p50_ms", "p99_ms", "ratio_vs_attnctl", "client_cpu_ms", "attn_call_s",
          "server_total_s", "server_compute_s", "other_s", "device", "notes", "transport"]

FORMS = ("unary", "stream", "async", "async_stream")
IMPLS = {"unary": "python_unary", "stream": "python_stream", "async": "python_async",
         "async_stream": "python_async_stream"}

SCENARIOS = {"small": dict(batch=1, seqlen=256, heads=16, head_dim=128),
             "large": dict(batch=4, seqlen=4096, heads=16, head_dim=128),
             "mid": dict(batch=4, seqlen=512, heads=16, head_dim=128)}


class Writer:
    def __init__(self, path: str, device: str):
        # A file may start with `#` lines (scripts/device/gpu-python.sh writes the
        # environment and the token comparisons there): the header goes after them.
        new = True
        if os.path.exists(path):
            with open(path) as f:
                new = not any(line.strip() and not line.startswith("#") for line in f)
        self.f = open(path, "a", newline="")
        self.w = csv.DictWriter(self.f, FIELDS)
        self.device = device
        if new:
            self.w.writeheader()

    def row(self, **kw) -> None:
        kw.setdefault("device", self.device)
        self.w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in kw.items()})
        self.f.flush()
        print(" ".join(f"{k}={v}" for k, v in kw.items() if v not in ("", None)), flush=True)


# -- the server ----------------------------------------------------------------
def start_server(binary: str, extra: List[str]) -> subprocess.Popen:
    proc = subprocess.Popen([binary, "--host=127.0.0.1", "--port=0", "--metrics_port=0", "--http_port=0",
                             "--backend=cuda", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        sys.stderr.write("server: " + line)
        m = re.search(r"listening on [^ ]*:(\d+) ", line)
        if m:
            proc.target = f"127.0.0.1:{m.group(1)}"
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            with Client(proc.target, timeout=5) as c:
                deadline = time.monotonic() + 120
                while c.health() != "SERVING":  # poll interval, not a readiness guess
                    if time.monotonic() > deadline:
                        raise RuntimeError("server never became SERVING")
                    time.sleep(0.1)
            return proc
    raise RuntimeError("attnserve exited before listening")


# -- (a) client throughput -----------------------------------------------------
def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process pid so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def attnctl_load(attnctl: str, target: str, sc: Dict, rpc: str, concurrency: int,
                 warmup: float, duration: float) -> Dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "load.csv")
        proc = subprocess.Popen(
            [attnctl, f"--target={target}", "load", f"--concurrency={concurrency}",
             f"--batch={sc['batch']}", f"--seqlen_q={sc['seqlen']}",
             f"--heads_q={sc['heads']}", f"--head_dim={sc['head_dim']}",
             "--dtype=bf16", f"--rpc={rpc}", f"--warmup={warmup}s",
             f"--duration={duration}s", f"--csv={path}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        # Its CPU over the measured window, as python_load's. Where the window
        # starts: attnctl's progress line (stderr, unbuffered) comes once a
        # second from 1 s after the step started.
        cpu_s = window_s = 0.0
        for line in proc.stderr:
            if line.startswith("["):
                start = time.monotonic() - 1.0 + warmup
                time.sleep(max(0.0, start + 0.1 - time.monotonic()))
                cpu0, t0 = process_cpu_s(proc.pid), time.monotonic()
                time.sleep(max(0.0, start + duration - 0.1 - time.monotonic()))
                cpu_s, window_s = process_cpu_s(proc.pid) - cpu0, time.monotonic() - t0
                break
        proc.stderr.read()
        proc.wait()
        # Exit code 1 with a row: no request completed inside the window (a slow
        # machine); the row (0 req/s) is the result. No row: attnctl failed.
        rows = list(csv.DictReader(open(path))) if os.path.exists(path) else []
        if not rows:
            raise RuntimeError(f"attnctl load wrote no result for {sc} {rpc} c{concurrency}")
        row = rows[-1]
    rate = float(row["req_per_s"])
    return dict(requests=int(row["requests"]), req_per_s=rate,
                tokens_per_s=float(row["tokens_per_s"]), p50_ms=float(row["p50_ms"]),
                p99_ms=float(row["p99_ms"]),
                client_cpu_ms=cpu_s * 1e3 / (rate * window_s) if rate and window_s else 0.0)


def grpcio_floor(client: Client, rpc: str, q, k, v) -> Callable[..., Any]:
    """grpcio with nothing of ours per call: the request's bytes built once, sent through
    an identity serializer, the response's bytes not even parsed. What a Python client
    on grpcio cannot beat (the --floor rows)."""
    method = client.channel.unary_unary(f"/attnserve.v1.Attention/{rpc.capitalize()}",
                                        request_serializer=lambda b: b,
                                        response_deserializer=lambda b: b)
    data = _request.build_request(q, k, v).data
    return lambda *_: method(data)


def with_transport(make: Callable[[], Any], transport: str) -> Any:
    """make() with $ATTNSERVE_TRANSPORT = transport (read when a client is made), checked."""
    asked = os.environ.get(_transport.ENV)
    os.environ[_transport.ENV] = transport
    try:
        client = make()
    finally:
        if asked is None:
            del os.environ[_transport.ENV]
        else:
            os.environ[_transport.ENV] = asked
    if client.transport != transport:
        raise RuntimeError(f"asked for the {transport} transport, got {client.transport}")
    return client


def python_load(client: Client, sc: Dict, rpc: str, concurrency: int, warmup: float,
                duration: float, form: str, floor: bool = False,
                transport: str = "") -> Dict[str, float]:
    """Closed loop like attnctl load: `concurrency` callers, each sending its next
    request when the last returns; only requests completing inside the window count.
    The arrays are made once, before the loop, as attnctl makes its inputs. The
    asyncio forms run their own AsyncClient (on `transport`) in a loop thread."""
    rng = np.random.default_rng(0)
    shape = (sc["batch"], sc["seqlen"], sc["heads"], sc["head_dim"])
    q, k, v = (rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
               for _ in range(3))
    start = time.monotonic() + warmup
    end = start + duration
    latencies: List[float] = []
    lock = threading.Lock()
    call = (grpcio_floor(client, rpc, q, k, v) if floor else
            client.echo if rpc == "echo" else client.forward)

    def caller(s=None):
        while True:
            t0 = time.monotonic()
            if t0 >= end:
                return
            if s is None:
                call(q, k, v)
            else:
                s.submit(q, k, v).result()
            t1 = time.monotonic()
            if start <= t1 <= end:
                with lock:
                    latencies.append(t1 - t0)

    async def async_callers() -> None:
        c = with_transport(lambda: AsyncClient(client.target, timeout=600), transport)
        async with c:
            s = c.stream() if form == "async_stream" else None
            one = c.echo if rpc == "echo" else c.forward

            async def coroutine() -> None:
                while True:
                    t0 = time.monotonic()
                    if t0 >= end:
                        return
                    if s is None:
                        await one(q, k, v)
                    else:
                        await (await s.submit(q, k, v))
                    t1 = time.monotonic()
                    if start <= t1 <= end:
                        latencies.append(t1 - t0)

            await asyncio.gather(*(coroutine() for _ in range(concurrency)))
            if s is not None:
                await s.close()

    def window_cpu_s() -> float:
        """This process's CPU seconds (all threads, user + system) over the window:
        the client's own cost, less sensitive than req/s to a loaded machine."""
        time.sleep(max(0.0, start - time.monotonic()))
        cpu0 = time.process_time()
        time.sleep(max(0.0, end - time.monotonic()))
        return time.process_time() - cpu0

    if form == "stream":  # one ForwardStream, `concurrency` requests in flight on it
        with client.stream() as s:
            threads = [threading.Thread(target=caller, args=(s,)) for _ in range(concurrency)]
            [t.start() for t in threads]
            cpu_s = window_cpu_s()
            [t.join() for t in threads]
    elif form in ("async", "async_stream"):  # one event loop in its own thread
        loop_thread = threading.Thread(target=asyncio.run, args=(async_callers(),))
        loop_thread.start()
        cpu_s = window_cpu_s()
        loop_thread.join()
    else:
        threads = [threading.Thread(target=caller) for _ in range(concurrency)]
        [t.start() for t in threads]
        cpu_s = window_cpu_s()
        [t.join() for t in threads]
    lat = np.array(latencies) * 1e3
    n = len(latencies)
    return dict(requests=n, req_per_s=n / duration, tokens_per_s=n * sc["batch"] * sc["seqlen"]
                / duration, p50_ms=float(np.percentile(lat, 50)) if n else 0.0,
                p99_ms=float(np.percentile(lat, 99)) if n else 0.0,
                client_cpu_ms=cpu_s * 1e3 / n if n else 0.0)


def bench_client(out: Writer, target: str, attnctl: str, warmup: float, duration: float,
                 scenarios: List[str], rpcs: List[str], concurrencies: List[int],
                 transports: List[str], forms: List[str], floor: bool, label: str) -> None:
    clients = {t: with_transport(lambda: Client(target, timeout=600), t)
               for t in transports + (["grpcio"] if floor else [])}
    try:
        for name in scenarios:
            sc = SCENARIOS[name]
            for rpc in rpcs:
                for conc in concurrencies:
                    base = attnctl_load(attnctl, target, sc, rpc, conc, warmup, duration)
                    common = dict(part="client", scenario=name, rpc=rpc, dtype="bf16",
                                  batch=sc["batch"], seqlen=sc["seqlen"], heads_q=sc["heads"],
                                  heads_kv=sc["heads"], head_dim=sc["head_dim"],
                                  concurrency=conc, seconds=duration, notes=label)
                    out.row(**common, impl="attnctl_load", **base, ratio_vs_attnctl=1.0)
                    runs = [(form, t) for form in forms for t in transports
                            if rpc == "forward" or "stream" not in form]  # Echo: no stream
                    if floor:
                        runs.append(("floor", "grpcio"))
                    for form, transport in runs:
                        r = python_load(clients[transport], sc, rpc, conc, warmup, duration,
                                        form, form == "floor", transport)
                        out.row(**common, impl=IMPLS.get(form, "grpcio_floor"),
                                transport=transport, **r,
                                ratio_vs_attnctl=r["req_per_s"] / base["req_per_s"]
                                if base["req_per_s"] else 0.0)
                        print(f"  {name} {rpc} c{conc} {form}/{transport}: "
                              f"{r['req_per_s']:.1f} req/s (attnctl {base['req_per_s']:.1f}), "
                              f"cpu {r['client_cpu_ms']:.2f} ms/req", flush=True)
    finally:
        for client in clients.values():
            client.close()


# -- (b) transformers generate() -------------------------------------------------
def model_configs(transformers):
    small = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
        pad_token_id=0, bos_token_id=1, eos_token_id=None, tie_word_embeddings=False)
    # Llama-3.2-1B's shape with a 32k vocabulary: ~1.1e9 parameters.
    one_b = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
        rope_theta=500000.0, pad_token_id=0, bos_token_id=1, eos_token_id=None,
        tie_word_embeddings=False)
    return {"llama-small": small, "llama-1b": one_b}


class CallTimer:
    """Wraps a method so its wall time and the server's timing are summed."""

    def __init__(self, owner, name: str):
        self.owner, self.name = owner, name
        self.original = getattr(owner, name)
        self.call_s = self.server_total_s = self.server_compute_s = 0.0
        timer = self

        def timed(*a, **kw):
            t0 = time.perf_counter()
            result = timer.original(*a, **kw)
            timer.call_s += time.perf_counter() - t0
            timer.server_total_s += result.timing.total_us * 1e-6
            timer.server_compute_s += result.timing.compute_us * 1e-6
            return result
        setattr(owner, name, timed)

    def restore(self) -> None:
        setattr(self.owner, self.name, self.original)


# Stateless generate() resends every layer's whole K/V each step: for the 1B
# model at batch 32 that is ~68 GB through Python gRPC per run, minutes for a
# number the K/V mode exists to avoid; it runs at batch 1 there.
STATELESS_MAX_BATCH = {"llama-1b": 1}


def bench_generate(out: Writer, target: str, prompt: int, new: int, model_names: List[str],
                   batches: List[int]) -> None:
    import torch
    import transformers
    import attnserve.hf
    from attnserve.hf_cache import ServerCache
    from attnserve.kv import Cache

    device = "cuda" if torch.cuda.is_available() else "cpu"
    client = attnserve.hf.register(Client(target, timeout=600))
    configs = model_configs(transformers)
    for model_name in model_names:
        cfg = configs[model_name]
        torch.manual_seed(0)
        models = {}
        for impl in ("sdpa", "attnserve"):
            c = cfg.__class__.from_dict(cfg.to_dict())  # from_config records the impl in it
            with torch.device(device):
                models[impl] = transformers.AutoModelForCausalLM.from_config(
                    c, attn_implementation=impl, dtype=torch.bfloat16).eval()
        models["attnserve"].load_state_dict(models["sdpa"].state_dict())
        params = sum(p.numel() for p in models["sdpa"].parameters())
        for batch in batches:
            g = torch.Generator(device="cpu").manual_seed(1)
            ids = torch.randint(2, cfg.vocab_size, (batch, prompt), generator=g).to(device)
            mask = torch.ones_like(ids)
            for impl in ("sdpa", "attnserve", "attnserve_kv"):
                if impl == "attnserve" and batch > STATELESS_MAX_BATCH.get(model_name, batch):
                    out.row(part="generate", impl=impl, model=model_name, batch=batch,
                            notes="skipped: stateless resends the whole K/V every step "
                                  "(STATELESS_MAX_BATCH)")
                    continue
                model = models["sdpa" if impl == "sdpa" else "attnserve"]
                timer = (CallTimer(Client, "forward_result") if impl == "attnserve" else
                         CallTimer(Cache, "append_attend_result") if impl == "attnserve_kv"
                         else None)

                def run():
                    kwargs = {}
                    cache = None
                    if impl == "attnserve_kv":
                        cache = ServerCache(client, cfg, max_tokens=prompt + new)
                        kwargs["past_key_values"] = cache
                    try:
                        with torch.no_grad():
                            model.generate(input_ids=ids, attention_mask=mask,
                                           max_new_tokens=new, min_new_tokens=new,
                                           do_sample=False, pad_token_id=0, **kwargs)
                    finally:
                        if cache is not None:
                            cache.close()
                try:
                    run()  # warm-up (CUDA kernels, connections)
                    if timer:
                        timer.call_s = timer.server_total_s = timer.server_compute_s = 0.0
                    if device == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    run()
                    if device == "cuda":
                        torch.cuda.synchronize()
                    seconds = time.perf_counter() - t0
                except Exception as e:  # a point that fails is reported, the rest runs
                    out.row(part="generate", impl=impl, model=model_name, batch=batch,
                            notes=f"FAILED: {type(e).__name__}: {e}"[:300])
                    continue
                finally:
                    if timer:
                        timer.restore()
                call_s = timer.call_s if timer else 0.0
                out.row(part="generate", scenario=f"prompt{prompt}", impl=impl, model=model_name,
                        dtype="bf16", batch=batch, seqlen=prompt,
                        heads_q=cfg.num_attention_heads, heads_kv=cfg.num_key_value_heads,
                        head_dim=cfg.hidden_size // cfg.num_attention_heads, new_tokens=new,
                        seconds=seconds, tokens_per_s=batch * new / seconds,
                        attn_call_s=call_s,
                        server_total_s=timer.server_total_s if timer else 0.0,
                        server_compute_s=timer.server_compute_s if timer else 0.0,
                        other_s=seconds - call_s, notes=f"params={params}")
        del models
        if device == "cuda":
            torch.cuda.empty_cache()
    client.close()


def print_summary(path: str) -> None:
    """The CSV's rows as two short tables (the last row of each point wins)."""
    with open(path) as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    client = {}
    for r in rows:
        if r["part"] == "client" and r["req_per_s"]:
            point = (r["scenario"], r.get("rpc") or "forward", r["concurrency"], r["notes"])
            impl = r["impl"] + (f"/{r['transport']}" if r.get("transport") and
                                r["impl"].startswith("python_") else "")
            client[point + (impl,)] = r
    def num(r: Dict[str, str], col: str, fmt: str) -> str:
        return format(float(r[col]), fmt) if r.get(col) else "-"

    if client:
        print("client throughput (req/s; ratio = Python / attnctl load, target >= 0.9; cpu = "
              "the client's CPU ms per request)")
        cols = [("attnctl_load", "attnctl")]
        for impl, title in (("python_unary", "unary"), ("python_stream", "stream"),
                            ("python_async", "async"), ("python_async_stream", "async stream")):
            cols += [(f"{impl}/native", f"{title} native"), (f"{impl}/grpcio", f"{title} grpcio"),
                     (impl, title)]  # rows without a transport (older CSVs)
        cols.append(("grpcio_floor", "grpcio floor"))
        present = [(impl, title) for impl, title in cols if any(k[4] == impl for k in client)]
        print(f"{'scenario':<8} {'rpc':<7} {'conc':>4} " +
              " ".join(f"{title + ' req/s':>19} {'ratio':>5} {'cpu':>6}" for _, title in present)
              + " label")
        for point in dict.fromkeys(k[:4] for k in client):
            sc, rpc, conc, label = point
            cells = []
            for impl, _ in present:
                r = client.get(point + (impl,), {})
                cells.append(f"{num(r, 'req_per_s', '.1f'):>19} "
                             f"{num(r, 'ratio_vs_attnctl', '.2f'):>5} "
                             f"{num(r, 'client_cpu_ms', '.2f'):>6}")
            print(f"{sc:<8} {rpc:<7} {conc:>4} " + " ".join(cells) + f" {label}")
    gen = [r for r in rows if r["part"] == "generate"]
    if gen:
        print("generate(): tokens/s, and where the measured run's seconds go: inside attnserve "
              "calls (client wall; of it, the server's total and compute) + the rest (the model)")
        for r in gen:
            head = f"{r['model']:<11} b={r['batch']:<3} {r['impl']:<13}"
            if not r["tokens_per_s"]:
                print(f"{head} {r['notes']}")
                continue
            print(f"{head} {num(r, 'tokens_per_s', '9.1f')} tok/s {num(r, 'seconds', '7.3f')} s = "
                  f"attn {num(r, 'attn_call_s', '.3f')} (server {num(r, 'server_total_s', '.3f')}, "
                  f"compute {num(r, 'server_compute_s', '.3f')}) + other {num(r, 'other_s', '.3f')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", required=True, help="append rows here (header if new)")
    ap.add_argument("--server", help="attnserve binary to start (--backend=cuda, free port)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra flag for the started server (repeatable)")
    ap.add_argument("--target", help="a running server instead of --server")
    ap.add_argument("--attnctl", default="attnctl", help="attnctl binary for part (a)")
    ap.add_argument("--parts", default="client,generate")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: --seconds=1,3 --prompt=64 --new-tokens=16")
    ap.add_argument("--seconds", default="3,15",
                    help="part (a): warm-up and measured seconds per point")
    ap.add_argument("--concurrency", default="1,16", help="part (a): closed-loop callers")
    ap.add_argument("--prompt", type=int, default=128, help="part (b): prompt tokens")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="part (b): torch CPU threads (0 = torch's default)")
    ap.add_argument("--new-tokens", type=int, default=128, help="part (b): generated tokens")
    ap.add_argument("--scenarios", default="small,large", help="part (a): of " + ",".join(SCENARIOS))
    ap.add_argument("--rpcs", default="forward", help="part (a): forward and/or echo")
    ap.add_argument("--transports", default="native,grpcio",
                    help="part (a): unary rows per transport (attnserve._transport); native "
                         "is left out where attnserve._native does not import")
    ap.add_argument("--forms", default="unary,stream",
                    help="part (a): of " + ",".join(FORMS) + " (see the module doc; "
                    "scripts/device/python-bench.sh runs all four)")
    ap.add_argument("--no-stream", action="store_true",
                    help="part (a): leave out the stream forms (sync and asyncio)")
    ap.add_argument("--floor", action="store_true",
                    help="part (a): also grpcio_floor rows (grpcio with a request built once "
                         "and nothing of ours per call: the best a client on grpcio can do)")
    ap.add_argument("--label", default="", help="part (a): the rows' notes (e.g. the client "
                    "version when comparing two)")
    ap.add_argument("--models", default="llama-small,llama-1b", help="part (b)")
    ap.add_argument("--batches", default="1,32", help="part (b): generate() batch sizes")
    a = ap.parse_args()
    if a.quick:
        a.seconds, a.prompt, a.new_tokens = "1,3", 64, 16
    warmup, duration = (float(x) for x in a.seconds.split(","))
    if bool(a.server) == bool(a.target):
        ap.error("give exactly one of --server and --target")
    proc = start_server(a.server, a.server_arg) if a.server else None
    target = proc.target if proc else a.target
    try:
        with Client(target) as c:
            info = c.info()
        device = f"{info.backend}:{info.devices[0].name}" if info.devices else info.backend
        out = Writer(a.csv, device)
        print(f"attnserve {attnserve.__version__} client, server {target} ({device})", flush=True)
        parts = a.parts.split(",")
        if "client" in parts:
            transports = [t for t in a.transports.split(",")
                          if t != "native" or _transport._native is not None]
            if transports != a.transports.split(","):
                print(f"attnserve._native does not import here ({_transport._NATIVE_MISSING}):"
                      f" transports {transports}", flush=True)
            bench_client(out, target, a.attnctl, warmup, duration, a.scenarios.split(","),
                         a.rpcs.split(","), [int(c) for c in a.concurrency.split(",")],
                         transports, [f for f in a.forms.split(",")
                                      if not (a.no_stream and "stream" in f)],
                         a.floor, a.label)
        if "generate" in parts:
            if a.torch_threads:
                import torch
                torch.set_num_threads(a.torch_threads)
            bench_generate(out, target, a.prompt, a.new_tokens, a.models.split(","),
                           [int(b) for b in a.batches.split(",")])
    finally:
        if proc:
            proc.terminate()
            proc.wait(timeout=60)
    print_summary(a.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
