# The v2 HTTP/REST side through tritonclient.http (2.50.0) and plain HTTP as a
# Kubernetes probe sends it: health, metadata, config, statistics, inference
# with binary tensors and with JSON tensors, errors.
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import reference
from test_grpc import NP_TYPE, TOLERANCE, inputs_for, random_qkv, rounded


@pytest.fixture(scope="module")
def client(server):
    return httpclient.InferenceServerClient(server.http_url)


def get(server, path):
    try:
        with urllib.request.urlopen(f"http://{server.http_url}{path}", timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_probes_and_metadata(server, client):
    assert get(server, "/v2/health/live")[0] == 200
    assert get(server, "/v2/health/ready")[0] == 200
    assert get(server, "/v2/models/attention/ready")[0] == 200
    assert get(server, "/v2/models/attention/versions/1/ready")[0] == 200
    status, body = get(server, "/v2/models/nope/ready")
    assert status == 404 and "'nope'" in json.loads(body)["error"]
    status, body = get(server, "/v2")
    assert status == 200 and json.loads(body)["name"] == "attnserve"
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("attention")
    meta = client.get_model_metadata("attention")
    assert [i["name"] for i in meta["inputs"]][:3] == ["q", "k", "v"]
    assert meta["inputs"][0]["shape"] == [-1, -1, -1, -1]
    config = client.get_model_config("attention")
    assert config["max_batch_size"] == 0 and config["input"][3]["optional"] is True
    stats = client.get_inference_statistics("attention")["model_stats"][0]
    assert stats["name"] == "attention" and stats["version"] == "1"
    assert {m["name"] for m in client.get_model_repository_index()} == {
        "attention", "attention_dense", "attention_kv"}


@pytest.mark.parametrize("datatype", ["FP32", "FP16", "BF16"])
def test_binary_tensors(client, datatype):
    rng = np.random.default_rng(20)
    q, k, v = random_qkv(rng)
    inputs = inputs_for({"q": q, "k": k, "v": v}, datatype, httpclient)
    r = client.infer("attention", inputs, parameters={"causal": True, "return_lse": True})
    want_o, want_lse = reference.attention(*(rounded(t, datatype) for t in (q, k, v)), causal=True)
    assert np.abs(r.as_numpy("o").astype(np.float64) - want_o).max() < TOLERANCE[datatype]
    assert np.abs(r.as_numpy("lse") - want_lse).max() < TOLERANCE[datatype]


@pytest.mark.parametrize("datatype", ["FP32", "FP16"])
def test_json_tensors(client, datatype):
    rng = np.random.default_rng(21)
    q, k, v = random_qkv(rng, b=1, sq=4, sk=6, hq=2, hkv=1, d=8)
    inputs = []
    for name, arr in (("q", q), ("k", k), ("v", v)):
        i = httpclient.InferInput(name, list(arr.shape), datatype)
        i.set_data_from_numpy(arr.astype(NP_TYPE[datatype]), binary_data=False)
        inputs.append(i)
    outputs = [httpclient.InferRequestedOutput("o", binary_data=False)]
    r = client.infer("attention", inputs, outputs=outputs, parameters={"window_left": 2})
    assert "data" in r.get_output("o")
    want_o, _ = reference.attention(*(rounded(t, datatype) for t in (q, k, v)), window_left=2)
    assert np.abs(r.as_numpy("o").astype(np.float64) - want_o).max() < TOLERANCE[datatype]


def test_varlen_over_http(client):
    rng = np.random.default_rng(22)
    cu_q, cu_k = [0, 2, 6], [0, 4, 9]
    q = rng.standard_normal((6, 2, 8))
    k = rng.standard_normal((9, 2, 8))
    v = rng.standard_normal((9, 2, 8))
    r = client.infer("attention", inputs_for(
        {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}, "FP32", httpclient))
    want_o, _ = reference.varlen_attention(q, k, v, cu_q, cu_k)
    assert np.abs(r.as_numpy("o") - want_o).max() < TOLERANCE["FP32"]


def test_errors_have_the_grpc_messages(server, client):
    import tritonclient.grpc as grpcclient
    rng = np.random.default_rng(23)
    q, k, v = random_qkv(rng)
    bad = {"q": q, "k": k[:, :5], "v": v}  # k and v disagree on Sk
    with pytest.raises(InferenceServerException) as http_error:
        client.infer("attention", inputs_for(bad, "FP32", httpclient))
    with pytest.raises(InferenceServerException) as grpc_error:
        grpcclient.InferenceServerClient(server.grpc_url).infer(
            "attention", inputs_for(bad, "FP32", grpcclient))
    assert http_error.value.status() == "400"
    assert http_error.value.message() == grpc_error.value.message()
    with pytest.raises(InferenceServerException) as e:
        client.infer("nope", inputs_for({"q": q, "k": k, "v": v}, "FP32", httpclient))
    assert e.value.status() == "404"


def test_malformed_bodies_are_400(server):
    def post(body, headers=None):
        req = urllib.request.Request(f"http://{server.http_url}/v2/models/attention/infer",
                                     data=body, headers=headers or {}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
    for body, headers, text in [
        (b"{not json", None, "expected a JSON object"),
        (b'{"inputs": 3}', None, "inputs: expected an array"),
        (b'{"inputs": [{"name": "q", "datatype": "FP32", "shape": [1], "data": ["x"]}]}', None,
         "expected numbers"),
        (b'{"inputs": []}', {"Inference-Header-Content-Length": "999"},
         "Inference-Header-Content-Length"),
        (b'{"inputs": [{"name": "q", "datatype": "FP32", "shape": [1], '
         b'"parameters": {"binary_data_size": 8}}]}abcd', {"Inference-Header-Content-Length": "88"},
         "binary_data_size"),
    ]:
        if headers and "88" in headers.values():
            headers = {"Inference-Header-Content-Length": str(len(body) - 4)}
        status, reply = post(body, headers)
        assert status == 400, reply
        assert text in json.loads(reply)["error"], reply


def test_same_request_limit_on_both_transports():
    import conftest
    import tritonclient.grpc as grpcclient
    small = conftest.Server("--max_request_bytes=4096")
    try:
        rng = np.random.default_rng(24)
        q, k, v = random_qkv(rng, b=1, sq=16, sk=16, hq=2, hkv=2, d=32)  # 12 KiB of FP32
        tensors = {"q": q, "k": k, "v": v}
        with pytest.raises(InferenceServerException) as http_error:
            httpclient.InferenceServerClient(small.http_url).infer(
                "attention", inputs_for(tensors, "FP32", httpclient))
        with pytest.raises(InferenceServerException) as grpc_error:
            grpcclient.InferenceServerClient(small.grpc_url).infer(
                "attention", inputs_for(tensors, "FP32", grpcclient))
        assert grpc_error.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert http_error.value.status() == "429"
        assert "max_request_bytes" in grpc_error.value.message()
        # Measured on the native request each becomes: the sizes differ by a
        # few bytes of id, the rule and the message do not.
        cut = lambda m: m.rsplit(", got", 1)[0]
        assert cut(http_error.value.message()) == cut(grpc_error.value.message())
    finally:
        small.stop()
