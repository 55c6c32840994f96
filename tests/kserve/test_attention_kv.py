# tritonclient.grpc (2.50.0, pinned) driving the K/V model attention_kv of a
# real CPU attnserve: a prefill-and-decode loop over a 2-layer cache made with
# the native API (attnctl kv create), unary and on one ModelStreamInfer stream,
# every output held to the float64 reference over the sequence's whole
# context; fork; and bad inputs, each answered with an error naming the input
# or parameter while the sequence stays as it was.
import os
import queue
import subprocess
import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

import reference

MODEL = "attention_kv"
LAYERS, HQ, HKV, D = 2, 4, 2, 32
TOLERANCE = 2e-4  # FP32 against float64, as test_grpc.py


def make_cache(server, layers=LAYERS, dtype="fp32"):
    """A cache made with the native API through attnctl; returns its id."""
    cache_id = f"v2-{uuid.uuid4().hex[:12]}"
    subprocess.run([os.environ["ATTNCTL_BIN"], f"--target={server.grpc_url}", "kv", "create",
                    f"--cache={cache_id}", f"--layers={layers}", f"--heads_kv={HKV}",
                    f"--head_dim={D}", f"--dtype={dtype}", "--page_size=16",
                    "--capacity_tokens=16384"], check=True, capture_output=True)
    return cache_id


def tensors(q, k, v, module=grpcclient):
    out = []
    for name, arr in (("q", q), ("k", k), ("v", v)):
        arr = np.asarray(arr, np.float32)
        t = module.InferInput(name, list(arr.shape), "FP32")
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


class Sequence:
    """One sequence's K/V per layer on the client, for the reference."""

    def __init__(self, rng, seq_id):
        self.rng, self.id = rng, seq_id
        self.k = [np.zeros((0, HKV, D)) for _ in range(LAYERS)]
        self.v = [np.zeros((0, HKV, D)) for _ in range(LAYERS)]

    def step(self, layer, tokens):
        """New q/k/v of `tokens` rows at `layer`, and the reference o, lse."""
        q = self.rng.standard_normal((tokens, HQ, D)).astype(np.float32)
        k = self.rng.standard_normal((tokens, HKV, D)).astype(np.float32)
        v = self.rng.standard_normal((tokens, HKV, D)).astype(np.float32)
        self.k[layer] = np.concatenate([self.k[layer], k])
        self.v[layer] = np.concatenate([self.v[layer], v])
        o, lse = reference.attention(q[None], self.k[layer][None], self.v[layer][None],
                                     causal=True)
        return q, k, v, o[0], lse[0]


def check(result, want_o, want_lse, length):
    assert np.abs(result.as_numpy("o") - want_o).max() < TOLERANCE
    assert np.abs(result.as_numpy("lse") - want_lse).max() < TOLERANCE
    params = result.get_response().parameters
    assert params["sequence_length"].int64_param == length


@pytest.fixture(scope="module")
def client(server):
    return grpcclient.InferenceServerClient(server.grpc_url)


def test_metadata_and_config(client):
    assert client.is_model_ready(MODEL)
    meta = client.get_model_metadata(MODEL, as_json=True)
    assert [i["name"] for i in meta["inputs"]] == ["q", "k", "v"]
    assert meta["inputs"][0]["shape"] == ["-1", "-1", "-1"]
    assert [o["name"] for o in meta["outputs"]] == ["o", "lse"]
    config = client.get_model_config(MODEL, as_json=True)["config"]
    assert "sequence_batching" in config
    assert int(config["sequence_batching"]["max_sequence_idle_microseconds"]) == 600_000_000
    index = client.get_model_repository_index(as_json=True)["models"]
    assert MODEL in {m["name"] for m in index}


def test_decode_loop_matches_reference(server, client):
    cache_id = make_cache(server)
    rng = np.random.default_rng(1)
    seqs = {1: (Sequence(rng, 101), 23), 2: (Sequence(rng, 102), 40)}
    steps = 4
    for n, (seq, prompt) in seqs.items():
        for t in range(steps + 1):
            tokens = prompt if t == 0 else 1
            length = prompt + t
            for layer in range(LAYERS):
                q, k, v, o, lse = seq.step(layer, tokens)
                params = {"cache_id": cache_id, "layer": layer, "causal": True,
                          "return_lse": True}
                if t > 0:
                    params["expected_length"] = length - 1  # the native retry guard
                r = client.infer(MODEL, tensors(q, k, v), parameters=params,
                                 sequence_id=seq.id, sequence_start=(t == 0 and layer == 0),
                                 sequence_end=(t == steps and layer == LAYERS - 1))
                check(r, o, lse, length)
    # sequence_end freed both sequences.
    q, k, v, _, _ = Sequence(rng, 0).step(0, 1)
    with pytest.raises(InferenceServerException) as e:
        client.infer(MODEL, tensors(q, k, v), parameters={"cache_id": cache_id, "layer": 0},
                     sequence_id=101)
    assert e.value.status() == "StatusCode.NOT_FOUND", e.value.message()


def test_generation_loop_on_one_stream(server, client):
    """The whole loop pipelined on one stream: arrival order applies per (sequence, layer)."""
    cache_id = make_cache(server)
    rng = np.random.default_rng(2)
    seqs = [(Sequence(rng, 201), 17), (Sequence(rng, 202), 5), (Sequence(rng, 203), 33)]
    results = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)),
                        headers={"x-attnserve-cache-id": cache_id})
    wanted = {}
    try:
        steps = 3
        for t in range(steps + 1):
            for seq, prompt in seqs:
                for layer in range(LAYERS):
                    q, k, v, o, lse = seq.step(layer, prompt if t == 0 else 1)
                    rid = f"{seq.id}-{t}-{layer}"
                    wanted[rid] = (o, lse, prompt + t)
                    client.async_stream_infer(
                        MODEL, tensors(q, k, v), request_id=rid, sequence_id=seq.id,
                        sequence_start=(t == 0 and layer == 0),
                        parameters={"layer": layer, "causal": True, "return_lse": True})
        seen = set()
        for _ in range(len(wanted)):
            result, error = results.get(timeout=120)
            assert error is None, error.message()
            rid = result.get_response().id
            check(result, *wanted[rid])
            seen.add(rid)
        assert seen == set(wanted)
    finally:
        client.stop_stream()
    # sequence_end once nothing else of the sequence is in flight (a pipelined
    # sequence_end while another layer's call runs cannot free it: kserve.md).
    empty_q, empty_kv = np.zeros((0, HQ, D)), np.zeros((0, HKV, D))
    for seq, _ in seqs:
        client.infer(MODEL, tensors(empty_q, empty_kv, empty_kv), sequence_id=seq.id,
                     sequence_end=True, parameters={"cache_id": cache_id, "layer": 0})


def test_fork_shares_the_prefix(server, client):
    cache_id = make_cache(server, layers=1)
    rng = np.random.default_rng(3)
    seq = Sequence(rng, 301)
    q, k, v, _, _ = seq.step(0, 20)
    client.infer(MODEL, tensors(q, k, v), parameters={"cache_id": cache_id},
                 sequence_id=301, sequence_start=True)
    # Attend only (no new rows) over the source and over its fork: same answer.
    probe = rng.standard_normal((2, HQ, D)).astype(np.float32)
    empty = np.zeros((0, HKV, D), np.float32)
    src = client.infer(MODEL, tensors(probe, empty, empty), parameters={"cache_id": cache_id},
                       sequence_id=301)
    fork = client.infer(MODEL, tensors(probe, empty, empty),
                        parameters={"cache_id": cache_id, "fork_from": 301, "fork_length": 20},
                        sequence_id=302, sequence_start=True, sequence_end=True)
    assert np.array_equal(src.as_numpy("o"), fork.as_numpy("o"))
    want = reference.attention(probe[None], seq.k[0][None], seq.v[0][None])[0][0]
    assert np.abs(fork.as_numpy("o") - want).max() < TOLERANCE


def bad_call(client, cache_id, q, k, v, code, text, **kwargs):
    params = kwargs.pop("parameters", {"cache_id": cache_id, "layer": 0})
    with pytest.raises(InferenceServerException) as e:
        client.infer(MODEL, tensors(q, k, v), parameters=params, **kwargs)
    assert e.value.status() == f"StatusCode.{code}", e.value.message()
    assert text in e.value.message(), e.value.message()


def test_errors_name_the_input_and_change_nothing(server, client):
    cache_id = make_cache(server)
    rng = np.random.default_rng(4)
    seq = Sequence(rng, 401)
    q, k, v, _, _ = seq.step(0, 6)
    client.infer(MODEL, tensors(q, k, v), parameters={"cache_id": cache_id, "layer": 0},
                 sequence_id=401, sequence_start=True)
    q1 = rng.standard_normal((1, HQ, D))
    k1 = rng.standard_normal((1, HKV, D))
    ok = {"cache_id": cache_id, "layer": 0}
    bad_call(client, cache_id, q1, k1, k1, "INVALID_ARGUMENT", "parameters['cache_id']",
             parameters={"layer": 0}, sequence_id=401)
    bad_call(client, cache_id, q1, k1, k1, "NOT_FOUND", "parameters['cache_id']",
             parameters={"cache_id": "no-such-cache", "layer": 0}, sequence_id=401)
    bad_call(client, cache_id, q1, k1, k1, "INVALID_ARGUMENT", "parameters['sequence_id']")
    bad_call(client, cache_id, q1, k1, k1, "INVALID_ARGUMENT", "parameters['layer']",
             parameters={"cache_id": cache_id}, sequence_id=401)
    bad_call(client, cache_id, q1, k1, k1, "INVALID_ARGUMENT", "parameters['layer']",
             parameters={"cache_id": cache_id, "layer": LAYERS}, sequence_id=401)
    bad_call(client, cache_id, q1, rng.standard_normal((1, HKV + 1, D)), k1, "INVALID_ARGUMENT",
             "inputs['k'].shape", sequence_id=401)
    bad_call(client, cache_id, q1, k1, rng.standard_normal((2, HKV, D)), "INVALID_ARGUMENT",
             "inputs['v'].shape", sequence_id=401)
    bad_call(client, cache_id, q1[0], k1, k1, "INVALID_ARGUMENT", "inputs['q'].shape",
             sequence_id=401)
    bad_call(client, cache_id, q1, k1, k1, "INVALID_ARGUMENT", "parameters['bogus']",
             parameters={**ok, "bogus": 1}, sequence_id=401)
    bad_call(client, cache_id, q1, k1, k1, "INVALID_ARGUMENT", "parameters['window_left']",
             parameters={**ok, "window_left": -2}, sequence_id=401)
    bad_call(client, cache_id, q1, k1, k1, "FAILED_PRECONDITION", "parameters['expected_length']",
             parameters={**ok, "expected_length": 5}, sequence_id=401)
    bad_call(client, cache_id, q1, k1, k1, "ALREADY_EXISTS", "parameters['sequence_start']",
             sequence_id=401, sequence_start=True)
    bad_call(client, cache_id, q1, k1, k1, "INVALID_ARGUMENT", "parameters['fork_from']",
             parameters={**ok, "fork_from": 401}, sequence_id=401)
    bad_call(client, cache_id, q1, k1, k1, "NOT_FOUND", "parameters['fork_from']",
             parameters={**ok, "fork_from": 999}, sequence_id=402, sequence_start=True)
    # A sequence_start whose append fails leaves no sequence behind.
    bad_call(client, cache_id, q1, rng.standard_normal((1, HKV + 1, D)), k1, "INVALID_ARGUMENT",
             "inputs['k'].shape", sequence_id=403, sequence_start=True)
    bad_call(client, cache_id, q1, k1, k1, "NOT_FOUND", "sequence 403", sequence_id=403)
    # A wrong dtype against an FP32 cache.
    with pytest.raises(InferenceServerException) as e:
        ins = []
        for name, arr in (("q", q1), ("k", k1), ("v", k1)):
            t = grpcclient.InferInput(name, list(arr.shape), "FP16")
            t.set_data_from_numpy(np.asarray(arr, np.float16))
            ins.append(t)
        client.infer(MODEL, ins, parameters=ok, sequence_id=401)
    assert "inputs['q'].datatype" in e.value.message(), e.value.message()
    # After all of that the sequence still has its 6 tokens at layer 0 and 0 at layer 1.
    q, k, v, o, lse = seq.step(0, 1)
    r = client.infer(MODEL, tensors(q, k, v),
                     parameters={**ok, "expected_length": 6, "causal": True,
                                 "return_lse": True}, sequence_id=401)
    check(r, o, lse, 7)
    q, k, v, o, lse = seq.step(1, 2)
    r = client.infer(MODEL, tensors(q, k, v),
                     parameters={"cache_id": cache_id, "layer": 1, "expected_length": 0,
                                 "causal": True, "return_lse": True}, sequence_id=401,
                     sequence_end=True)
    check(r, o, lse, 2)


def test_http_with_the_cache_header(server):
    """The HTTP/REST side: the cache named by the x-attnserve-cache-id header."""
    import tritonclient.http as httpclient
    cache_id = make_cache(server, layers=1)
    client = httpclient.InferenceServerClient(server.http_url)
    seq = Sequence(np.random.default_rng(5), 501)
    for t, tokens in enumerate((9, 1, 1)):
        q, k, v, o, lse = seq.step(0, tokens)
        r = client.infer(MODEL, tensors(q, k, v, httpclient), sequence_id=501,
                         sequence_start=t == 0, sequence_end=t == 2,
                         parameters={"causal": True, "return_lse": True},
                         headers={"x-attnserve-cache-id": cache_id})
        assert np.abs(r.as_numpy("o") - o).max() < TOLERANCE
        assert np.abs(r.as_numpy("lse") - lse).max() < TOLERANCE
    with pytest.raises(InferenceServerException) as e:
        client.infer(MODEL, tensors(q, k, v, httpclient), sequence_id=501,
                     headers={"x-attnserve-cache-id": cache_id})
    assert "sequence 501" in e.value.message()
