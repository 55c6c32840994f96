# Triton's system shared-memory extension through tritonclient (gRPC and
# HTTP): inputs read from and outputs written to regions, every bound checked
# (INVALID_ARGUMENT naming the region), status listing, unregister, the
# extension off without --allow_client_shm, and a client that shrinks its
# object: that call fails naming the region and the server process serves on.
import os

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

import reference

F32 = 4


@pytest.fixture
def region():
    """A fresh POSIX shm object big enough for q, k, v and o (and lse)."""
    key = f"/attnserve_test_{os.getpid()}_{np.random.randint(1 << 30)}"
    handle = shm.create_shared_memory_region("unused", key, 1 << 16)
    yield key, handle
    shm.destroy_shared_memory_region(handle)


def shm_input(module, name, arr, region_name, offset):
    i = module.InferInput(name, list(arr.shape), "FP32")
    i.set_shared_memory(region_name, arr.nbytes, offset)
    return i


def listed_regions(client):
    """The system regions the server lists, from either client."""
    if isinstance(client, httpclient.InferenceServerClient):
        return client.get_system_shared_memory_status()
    return client.get_system_shared_memory_status(as_json=True).get("regions", {}).values()


def layout(q, k, v):
    """q, k, v then o back to back in one region: their offsets and the end."""
    offsets, at = {}, 0
    for name, arr in (("q", q), ("k", k), ("v", v), ("o", q)):
        offsets[name] = at
        at += arr.nbytes
    return offsets, at


@pytest.mark.parametrize("module_name", ["grpc", "http"])
def test_inputs_and_outputs_in_system_shared_memory(server, region, module_name):
    module = grpcclient if module_name == "grpc" else httpclient
    client = module.InferenceServerClient(server.grpc_url if module_name == "grpc" else server.http_url)
    key, handle = region
    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, 7, 2, 16)).astype(np.float32)
    k = rng.standard_normal((1, 9, 2, 16)).astype(np.float32)
    v = rng.standard_normal((1, 9, 2, 16)).astype(np.float32)
    offsets, end = layout(q, k, v)
    for name, arr in (("q", q), ("k", k), ("v", v)):
        shm.set_shared_memory_region(handle, [arr], offset=offsets[name])
    name = f"data_{module_name}"
    client.register_system_shared_memory(name, key, end)
    try:
        assert any(r["name"] == name and r["key"] == key for r in listed_regions(client))
        inputs = [shm_input(module, n, a, name, offsets[n]) for n, a in (("q", q), ("k", k), ("v", v))]
        out = module.InferRequestedOutput("o")
        out.set_shared_memory(name, q.nbytes, offsets["o"])
        result = client.infer("attention", inputs, outputs=[out], parameters={"causal": True})
        assert result.get_output("o") is not None
        o = shm.get_contents_as_numpy(handle, np.float32, list(q.shape), offset=offsets["o"])
        want, _ = reference.attention(q, k, v, causal=True)
        assert np.abs(o - want).max() < 2e-4
    finally:
        client.unregister_system_shared_memory(name)
    assert not any(r["name"] == name for r in listed_regions(client))


def expect_invalid(call, *texts):
    with pytest.raises(InferenceServerException) as e:
        call()
    assert "INVALID_ARGUMENT" in str(e.value.status()) or e.value.status() == "400", e.value
    for t in texts:
        assert t in e.value.message(), e.value.message()


def test_bad_regions_are_invalid_argument_naming_them(server, region):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    key, handle = region
    q = np.zeros((1, 4, 1, 8), np.float32)
    client.register_system_shared_memory("small", key, 256, offset=128)
    try:
        def run(inputs, outputs=None):
            return lambda: client.infer("attention", inputs, outputs=outputs)
        dense = lambda n: grpcclient.InferInput(n, list(q.shape), "FP32")
        def plain(n):
            i = dense(n)
            i.set_data_from_numpy(q)
            return i
        # An unregistered name.
        missing = dense("q")
        missing.set_shared_memory("nobody", q.nbytes)
        expect_invalid(run([missing, plain("k"), plain("v")]), "'nobody'")
        # An offset past the end.
        past = dense("q")
        past.set_shared_memory("small", q.nbytes, offset=300)
        expect_invalid(run([past, plain("k"), plain("v")]), "'small'", "exceeds")
        # A byte size beyond the region.
        large = dense("q")
        large.set_shared_memory("small", 512)
        expect_invalid(run([large, plain("k"), plain("v")]), "'small'", "exceeds")
        # An output region too small for o.
        out = grpcclient.InferRequestedOutput("o")
        out.set_shared_memory("small", 16)
        expect_invalid(run([plain("q"), plain("k"), plain("v")], [out]), "'small'", "16")
        # Registering past the end of the shm object, and twice.
        expect_invalid(lambda: client.register_system_shared_memory("huge", key, 1 << 20), "'huge'")
        with pytest.raises(InferenceServerException) as e:
            client.register_system_shared_memory("small", key, 64)
        assert e.value.status() == "StatusCode.ALREADY_EXISTS"
        with pytest.raises(InferenceServerException) as e:
            client.register_system_shared_memory("nokey", "/attnserve_no_such_key", 64)
        assert "'nokey'" in e.value.message()
    finally:
        client.unregister_system_shared_memory("small")
    # Unknown names: status NOT_FOUND, unregister a no-op, as in Triton.
    with pytest.raises(InferenceServerException) as e:
        client.get_system_shared_memory_status("small")
    assert e.value.status() == "StatusCode.NOT_FOUND"
    client.unregister_system_shared_memory("small")


def test_shared_memory_off_without_the_flag(server_without_shm, region):
    client = grpcclient.InferenceServerClient(server_without_shm.grpc_url)
    assert "system_shared_memory" not in client.get_server_metadata(as_json=True)["extensions"]
    key, _ = region
    with pytest.raises(InferenceServerException) as e:
        client.register_system_shared_memory("r", key, 64)
    assert e.value.status() == "StatusCode.FAILED_PRECONDITION"
    assert "--allow_client_shm" in e.value.message()


def test_cuda_shared_memory_needs_a_cuda_build_and_a_gpu(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    extensions = client.get_server_metadata(as_json=True)["extensions"]
    if "cuda_shared_memory" in extensions:
        pytest.skip("a CUDA build: CUDA shared memory is tested on the GPU machine")
    with pytest.raises(InferenceServerException) as e:
        client.register_cuda_shared_memory("c", b"\0" * 64, 0, 64)
    # UNIMPLEMENTED without CUDA; FAILED_PRECONDITION in a CUDA build on a
    # machine without a GPU (as in CI).
    assert e.value.status() in ("StatusCode.UNIMPLEMENTED", "StatusCode.FAILED_PRECONDITION")
    assert "'c'" in e.value.message()
    assert client.get_cuda_shared_memory_status(as_json=True).get("regions", {}) == {}


@pytest.mark.parametrize("module_name", ["grpc", "http"])
def test_a_shrunk_object_fails_the_call_and_the_server_serves_on(server, region, module_name):
    module = grpcclient if module_name == "grpc" else httpclient
    client = module.InferenceServerClient(server.grpc_url if module_name == "grpc" else server.http_url)
    key, handle = region
    rng = np.random.default_rng(12)
    q = rng.standard_normal((1, 32, 2, 32)).astype(np.float32)  # 8 KiB; four fit the region
    offsets, end = layout(q, q, q)
    for name in ("q", "k", "v"):
        shm.set_shared_memory_region(handle, [q], offset=offsets[name])
    name = f"shrunk_{module_name}"
    client.register_system_shared_memory(name, key, end)
    try:
        # The client truncates its object to less than the region: the
        # server's mapping of q, k, v and o now lies past the object's end.
        fd = os.open("/dev/shm" + key, os.O_RDWR)
        try:
            os.ftruncate(fd, 4096)
        finally:
            os.close(fd)
        inputs = [shm_input(module, n, q, name, offsets[n]) for n in ("q", "k", "v")]
        out = module.InferRequestedOutput("o")
        out.set_shared_memory(name, q.nbytes, offsets["o"])
        with pytest.raises(InferenceServerException) as e:
            client.infer("attention", inputs, outputs=[out])
        assert f"shared memory region '{name}'" in e.value.message(), e.value.message()
    finally:
        client.unregister_system_shared_memory(name)
    assert client.is_server_live()
    plain = []
    for n in ("q", "k", "v"):
        i = module.InferInput(n, list(q.shape), "FP32")
        i.set_data_from_numpy(q)
        plain.append(i)
    want, _ = reference.attention(q, q, q, causal=False)
    assert np.abs(client.infer("attention", plain).as_numpy("o") - want).max() < 2e-4
