# tritonclient.grpc (2.50.0, pinned) against a real CPU attnserve: metadata,
# every dtype, every option, GQA, varlen, typed FP32 contents, errors and
# streaming, compared with a float64 reference (reference.py).
import queue

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

import reference

TOLERANCE = {"FP32": 2e-4, "FP16": 2e-2, "BF16": 8e-2}
NP_TYPE = {"FP32": np.float32, "FP16": np.float16, "BF16": np.float32}


def rounded(x, datatype):
    """x as the server sees it in `datatype`, back in float64."""
    if datatype == "BF16":
        bits = np.asarray(x, np.float32).view(np.uint32)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
        return bits.view(np.float32).astype(np.float64)
    return np.asarray(x, NP_TYPE[datatype]).astype(np.float64)


def inputs_for(tensors, datatype, module=grpcclient):
    out = []
    for name, value in tensors.items():
        dt = "INT32" if name.startswith("cu_seqlens") else datatype
        arr = np.asarray(value, np.int32 if dt == "INT32" else NP_TYPE[datatype])
        i = module.InferInput(name, list(arr.shape), dt)
        i.set_data_from_numpy(arr)
        out.append(i)
    return out


def random_qkv(rng, b=2, sq=9, sk=13, hq=4, hkv=2, d=32):
    return (rng.standard_normal((b, sq, hq, d)), rng.standard_normal((b, sk, hkv, d)),
            rng.standard_normal((b, sk, hkv, d)))


@pytest.fixture(scope="module")
def client(server):
    return grpcclient.InferenceServerClient(server.grpc_url)


def test_server_and_model_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "attnserve"
    assert {"binary_tensor_data", "parameters", "statistics",
            "system_shared_memory"} <= set(meta["extensions"])
    assert client.is_model_ready("attention") and client.is_model_ready("attention", "1")
    model = client.get_model_metadata("attention", as_json=True)
    assert [i["name"] for i in model["inputs"]] == [
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "sinks", "bias", "mask",
        "block_row_ptr", "block_col_idx"]
    assert model["inputs"][0]["shape"] == ["-1", "-1", "-1", "-1"]
    assert [o["name"] for o in model["outputs"]] == ["o", "lse"]
    config = client.get_model_config("attention", as_json=True)["config"]
    assert int(config.get("max_batch_size", 0)) == 0  # proto3 JSON leaves zeros out
    assert [i.get("optional", False) for i in config["input"]] == [False] * 3 + [True] * 8
    assert config["input"][8]["data_type"] == "TYPE_BOOL"
    index = client.get_model_repository_index(as_json=True)["models"]
    assert {m["name"] for m in index} == {"attention", "attention_dense", "attention_kv"}
    assert all(m["state"] == "READY" for m in index)


def test_unknown_model_and_version(client):
    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("nope")
    assert e.value.status() == "StatusCode.NOT_FOUND" and "'nope'" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        client.is_model_ready("attention", "2")
    assert e.value.status() == "StatusCode.NOT_FOUND"


@pytest.mark.parametrize("datatype", ["FP32", "FP16", "BF16"])
def test_every_dtype_matches_reference(client, datatype):
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng)
    r = client.infer("attention", inputs_for({"q": q, "k": k, "v": v}, datatype),
                     parameters={"return_lse": True})
    want_o, want_lse = reference.attention(*(rounded(t, datatype) for t in (q, k, v)))
    o = r.as_numpy("o").astype(np.float64)
    assert r.get_output("o").datatype == datatype and list(o.shape) == list(q.shape)
    assert np.abs(o - want_o).max() < TOLERANCE[datatype]
    assert np.abs(r.as_numpy("lse") - want_lse).max() < TOLERANCE[datatype]
    params = r.get_response().parameters
    assert params["backend"].string_param == "cpu" and params["batch_size"].int64_param >= 1


@pytest.mark.parametrize("options", [
    {"causal": True},
    {"window_left": 3, "window_right": 2},
    {"causal": True, "window_left": 4},
    {"softcap": 5.0},
    {"softmax_scale": 0.05},
    {"causal": True, "softcap": 2.5, "softmax_scale": 0.3, "window_left": 6},
])
def test_every_option_matches_reference(client, options):
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng)
    r = client.infer("attention", inputs_for({"q": q, "k": k, "v": v}, "FP32"),
                     parameters={**options, "return_lse": True})
    want_o, want_lse = reference.attention(*(rounded(t, "FP32") for t in (q, k, v)), **options)
    assert np.abs(r.as_numpy("o") - want_o).max() < TOLERANCE["FP32"]
    lse = r.as_numpy("lse")
    assert np.array_equal(np.isinf(lse), np.isinf(want_lse))
    finite = np.isfinite(want_lse)
    assert np.abs(lse[finite] - want_lse[finite]).max() < TOLERANCE["FP32"]


def test_options_as_strings_and_lse_by_request(client):
    # perf_analyzer's --request-parameter sends strings; requesting lse asks for it.
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng)
    outputs = [grpcclient.InferRequestedOutput("lse"), grpcclient.InferRequestedOutput("o")]
    r = client.infer("attention", inputs_for({"q": q, "k": k, "v": v}, "FP32"),
                     parameters={"causal": "true", "softcap": "3.5"}, outputs=outputs)
    want_o, want_lse = reference.attention(q, k, v, causal=True, softcap=3.5)
    assert [o.name for o in r.get_response().outputs] == ["lse", "o"]
    assert np.abs(r.as_numpy("o") - want_o).max() < TOLERANCE["FP32"]
    assert np.abs(r.as_numpy("lse") - want_lse).max() < TOLERANCE["FP32"]


def test_no_lse_unless_asked(client):
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng)
    r = client.infer("attention", inputs_for({"q": q, "k": k, "v": v}, "FP16"))
    assert [o.name for o in r.get_response().outputs] == ["o"]


def test_varlen(client):
    rng = np.random.default_rng(5)
    cu_q, cu_k = [0, 3, 3, 10], [0, 5, 9, 17]
    q = rng.standard_normal((cu_q[-1], 4, 16))
    k = rng.standard_normal((cu_k[-1], 2, 16))
    v = rng.standard_normal((cu_k[-1], 2, 16))
    r = client.infer("attention", inputs_for(
        {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}, "FP32"),
        parameters={"causal": True, "return_lse": True})
    want_o, want_lse = reference.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    assert np.abs(r.as_numpy("o") - want_o).max() < TOLERANCE["FP32"]
    assert r.as_numpy("lse").shape == (4, 10)
    assert np.abs(r.as_numpy("lse") - want_lse).max() < TOLERANCE["FP32"]


def raw_request(tensors, parameters=None, model="attention"):
    """A ModelInferRequest built by hand with tritonclient's own messages."""
    request = service_pb2.ModelInferRequest(model_name=model, id="typed")
    for name, arr in tensors.items():
        t = request.inputs.add(name=name, datatype="FP32", shape=list(arr.shape))
        t.contents.fp32_contents.extend(np.asarray(arr, np.float32).ravel().tolist())
    for key, value in (parameters or {}).items():
        request.parameters[key].bool_param = value
    return request


def test_fp32_typed_contents(server):
    rng = np.random.default_rng(6)
    q, k, v = random_qkv(rng, b=1)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(server.grpc_url))
    response = stub.ModelInfer(raw_request({"q": q, "k": k, "v": v}, {"causal": True}))
    assert response.id == "typed" and response.model_version == "1"
    o = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(q.shape)
    want_o, _ = reference.attention(rounded(q, "FP32"), rounded(k, "FP32"), rounded(v, "FP32"),
                                    causal=True)
    assert np.abs(o - want_o).max() < TOLERANCE["FP32"]


@pytest.mark.parametrize("change, code, text", [
    (lambda t, p: t.update(q=np.zeros((2, 9, 4, 32), np.float64)) or ("FP64", p),
     "INVALID_ARGUMENT", "inputs['q'].datatype: expected FP16, BF16 or FP32"),
    (lambda t, p: (t.pop("k"), ("FP32", p))[1], "INVALID_ARGUMENT", "'k' is missing"),
    (lambda t, p: t.update(x=np.zeros(3)) or ("FP32", p), "INVALID_ARGUMENT",
     "inputs['x']: model 'attention' has no such input"),
    (lambda t, p: ("FP32", {**p, "casual": True}), "INVALID_ARGUMENT",
     "parameters['casual']: expected one of causal"),
    (lambda t, p: ("FP32", {**p, "causal": 3}), "INVALID_ARGUMENT",
     "parameters['causal']: expected a bool, got int64"),
    (lambda t, p: ("FP32", {**p, "softcap": -1.0}), "INVALID_ARGUMENT", "softcap"),
    (lambda t, p: t.update(v=np.zeros((2, 12, 2, 32))) or ("FP32", p), "INVALID_ARGUMENT",
     "v"),
])
def test_errors(client, change, code, text):
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng)
    tensors = {"q": q, "k": k, "v": v}
    datatype, params = change(tensors, {})
    inputs = []
    for name, arr in tensors.items():
        dt = "FP64" if datatype == "FP64" and name == "q" else "FP32"
        i = grpcclient.InferInput(name, list(arr.shape), dt)
        i.set_data_from_numpy(np.asarray(arr, np.float64 if dt == "FP64" else np.float32))
        inputs.append(i)
    with pytest.raises(InferenceServerException) as e:
        client.infer("attention", inputs, parameters=params)
    assert e.value.status() == f"StatusCode.{code}", e.value.message()
    assert text in e.value.message()


def test_over_max_tokens_is_resource_exhausted(server):
    rng = np.random.default_rng(8)
    import conftest
    small = conftest.Server("--max_tokens=16")
    try:
        c = grpcclient.InferenceServerClient(small.grpc_url)
        q, k, v = random_qkv(rng)
        with pytest.raises(InferenceServerException) as e:
            c.infer("attention", inputs_for({"q": q, "k": k, "v": v}, "FP32"))
        assert e.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "max_tokens" in e.value.message()
    finally:
        small.stop()


def test_streaming_answers_every_request_and_errors_in_band(client):
    rng = np.random.default_rng(9)
    results = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        wanted = {}
        for n in range(6):
            q, k, v = random_qkv(rng, sq=5 + n)
            wanted[f"r{n}"] = reference.attention(q, k, v, causal=n % 2 == 1)[0]
            client.async_stream_infer("attention", inputs_for({"q": q, "k": k, "v": v}, "FP32"),
                                      request_id=f"r{n}", parameters={"causal": n % 2 == 1})
        bad = inputs_for({"q": q, "k": k}, "FP32")
        client.async_stream_infer("attention", bad, request_id="bad")
        seen = {}
        for _ in range(7):
            result, error = results.get(timeout=120)
            if error is not None:
                seen["bad"] = error
            else:
                seen[result.get_response().id] = result.as_numpy("o")
    finally:
        client.stop_stream()
    assert "'v' is missing" in seen.pop("bad").message()
    assert set(seen) == set(wanted)
    for rid, o in seen.items():
        assert np.abs(o - wanted[rid]).max() < TOLERANCE["FP32"]


def test_statistics_count_requests(client):
    before = client.get_inference_statistics("attention", as_json=True)["model_stats"][0]
    rng = np.random.default_rng(10)
    q, k, v = random_qkv(rng)
    client.infer("attention", inputs_for({"q": q, "k": k, "v": v}, "FP32"))
    after = client.get_inference_statistics("attention", as_json=True)["model_stats"][0]
    count = lambda s: int(s.get("inference_count", 0))
    assert count(after) >= count(before) + 1
    assert int(after["inference_stats"]["success"]["count"]) >= count(before) + 1
    assert int(after["last_inference"]) > 0
