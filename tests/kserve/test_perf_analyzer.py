# perf_analyzer, the binary inside the tritonclient 2.50.0 wheel, drives a
# real CPU attnserve for a short run over gRPC and HTTP, with tensors in the
# messages and in system shared memory; every run must end with zero errors,
# by perf_analyzer's exit status and by the server's own failure count.
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import Server

REQUESTS = 40
RUN_TIMEOUT_S = 120  # a run takes a few seconds, even on the loaded CI machine
SHAPE = [1, 32, 2, 64]


def perf_analyzer():
    binary = Path(sys.executable).parent / "perf_analyzer"
    # Newer perf-analyzer wheels install a placeholder without a binary on
    # glibc < 2.38; the pinned tritonclient 2.50.0 ships the real one.
    assert binary.is_file() and binary.stat().st_size > 1_000_000, f"no perf_analyzer at {binary}"
    import nvidia.cuda_runtime  # noqa: the wheel that supplies libcudart.so.12
    libs = [str(Path(p) / "lib") for p in nvidia.cuda_runtime.__path__]
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(libs + [env.get("LD_LIBRARY_PATH", "")])
    return binary, env


@pytest.fixture(scope="module")
def input_data(tmp_path_factory):
    """q, k, v as FP16 (perf_analyzer takes FP16 only as base64)."""
    rng = np.random.default_rng(30)
    step = {n: {"b64": base64.b64encode(rng.standard_normal(SHAPE).astype(np.float16).tobytes())
                .decode(), "shape": SHAPE} for n in ("q", "k", "v")}
    path = tmp_path_factory.mktemp("perf") / "qkv.json"
    path.write_text(json.dumps({"data": [step]}))
    return path


def run_perf_analyzer(args, env, server):
    """One perf_analyzer run. A run past RUN_TIMEOUT_S fails with what it
    had printed, whether the server still answers ServerReady (a hung server
    or a hung client) and the server log's tail: one such run in CI (sequence
    mode, no shared memory, 2026-11-26) left only "Request concurrency: 2"
    behind, and 32 reruns of that test passed."""
    try:
        return subprocess.run(args, env=env, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        printed = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        try:
            ready = grpcclient.InferenceServerClient(server.grpc_url).is_server_ready(
                client_timeout=10)
        except Exception as err:  # noqa: the answer, or why there was none
            ready = f"no answer: {err}"
        pytest.fail(f"perf_analyzer ran past {RUN_TIMEOUT_S} s; it printed:\n{printed}\n"
                    f"server ready afterwards: {ready}\nserver log tail:\n"
                    + "".join(server.log[-40:]))


def counts(server):
    stats = grpcclient.InferenceServerClient(server.grpc_url).get_inference_statistics(
        "attention_dense", as_json=True)["model_stats"][0]
    return (int(stats["inference_stats"]["success"].get("count", 0)),
            int(stats["inference_stats"]["fail"].get("count", 0)))


@pytest.mark.parametrize("protocol, shared_memory", [
    ("grpc", "none"), ("grpc", "system"), ("http", "none"), ("http", "system")])
def test_perf_analyzer_runs_without_errors(server, input_data, protocol, shared_memory):
    binary, env = perf_analyzer()
    url = server.grpc_url if protocol == "grpc" else server.http_url
    # attention_dense: perf_analyzer 2.50 refuses shared memory for a model
    # with optional inputs (attention's cu_seqlens_q/k).
    args = [str(binary), "-m", "attention_dense", "-u", url, "-i", protocol,
            "--input-data", str(input_data), "--concurrency-range", "2",
            "--request-count", str(REQUESTS), f"--shared-memory={shared_memory}"]
    if shared_memory != "none":
        args.append(f"--output-shared-memory-size={int(np.prod(SHAPE)) * 2}")
    success_before, fail_before = counts(server)
    run = run_perf_analyzer(args, env, server)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "error" not in output.lower(), output
    assert "throughput:" in output, output
    success_after, fail_after = counts(server)
    assert fail_after == fail_before, output
    assert success_after - success_before >= REQUESTS, output


def run_sequence_mode(server, tmp_path, cache_id, shared_memory):
    """perf_analyzer in sequence mode on attention_kv against `cache_id`;
    asserts a clean run and that the ended sequences were freed."""
    binary, env = perf_analyzer()
    rng = np.random.default_rng(31)
    step = {n: {"b64": base64.b64encode(rng.standard_normal((1, h, 64)).astype(np.float16)
                                        .tobytes()).decode(), "shape": [1, h, 64]}
            for n, h in (("q", 4), ("k", 2), ("v", 2))}
    data = tmp_path / "kv.json"
    data.write_text(json.dumps({"data": [step]}))
    args = [str(binary), "-m", "attention_kv", "-u", server.grpc_url, "-i", "grpc",
            "--input-data", str(data), "--concurrency-range", "2", "--request-count",
            str(REQUESTS), "--sequence-length", "5", "--request-parameter",
            f"cache_id:{cache_id}:string", f"--shared-memory={shared_memory}"]
    if shared_memory != "none":
        args.append("--output-shared-memory-size=1024")
    run = run_perf_analyzer(args, env, server)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "error" not in output.lower(), output
    assert "Sequence count:" in output, output
    # Every sequence perf_analyzer ended was freed (it may stop mid-sequence).
    info = subprocess.run([os.environ["ATTNCTL_BIN"], f"--target={server.grpc_url}", "kv",
                           "info", f"--cache={cache_id}", "--json"], check=True,
                          capture_output=True, text=True).stdout
    assert int(json.loads(info)["stats"]["sequences"]) <= 2, info


@pytest.mark.parametrize("shared_memory", ["none", "system"])
def test_perf_analyzer_sequence_mode_drives_attention_kv(server, tmp_path, shared_memory):
    """attention_kv's config reports sequence_batching, so perf_analyzer sends
    sequence_id / sequence_start / sequence_end: each of its sequences is a
    decode loop on a cache made with the native API, ended (freed) at its end."""
    cache_id = f"pa-{shared_memory}"
    subprocess.run([os.environ["ATTNCTL_BIN"], f"--target={server.grpc_url}", "kv", "create",
                    f"--cache={cache_id}", "--layers=1", "--heads_kv=2", "--head_dim=64",
                    "--dtype=fp16", "--page_size=16", "--capacity_tokens=65536"], check=True,
                   capture_output=True)
    run_sequence_mode(server, tmp_path, cache_id, shared_memory)


def test_perf_analyzer_alone_drives_a_startup_cache(tmp_path):
    """The cache comes only from --kv_startup_cache: no native client runs."""
    s = Server("--allow_client_shm", "--kv_startup_cache=boot:layers=1,hkv=2,d=64,dtype=FP16,"
               "page_size=16,capacity_tokens=65536")
    try:
        assert any("K/V cache 'boot'" in line for line in s.log), "".join(s.log)
        run_sequence_mode(s, tmp_path, "boot", "none")
    finally:
        s.stop()


@pytest.mark.parametrize("spec, message", [
    ("boot:layers=1,hkv=2,d=64,dtype=FP8,capacity_tokens=64", "dtype: expected FP16, BF16"),
    ("boot:layers=1,hkv=2,d=64,dtype=FP16", "exactly one of capacity_tokens"),
    ("boot:layers=1,hkv=2,d=60,dtype=FP16,capacity_tokens=64", "head_dim: expected a multiple"),
    ("boot:layers=1,hkv=2,d=64,dtype=FP16,page_size=24,capacity_tokens=64", "page_size"),
])
def test_bad_startup_cache_stops_startup(spec, message):
    run = subprocess.run([os.environ["ATTNSERVE_BIN"], "--host=127.0.0.1", "--port=0",
                          "--backend=cpu", "--metrics_port=0", "--http_port=0",
                          f"--kv_startup_cache={spec}"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0, run.stdout + run.stderr
    assert "--kv_startup_cache: cache 'boot'" in run.stdout + run.stderr, run.stdout + run.stderr
    assert message in run.stdout + run.stderr, run.stdout + run.stderr
