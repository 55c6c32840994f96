"""Same-host shared memory in the Python client (attnserve.shm, Cache.append_attend(shm=...)).

Three parts:
- against a stand-in server in this process (grpcio: SharedMemory and the KvCache calls a
  Cache makes, reading q/k/v from the registered POSIX objects and writing O there, the
  attention from reference.py): the client's side alone, on any server build: regions
  made under the tenant's prefix, registered, named by the request with no bytes in it,
  O read from where the response says, everything unregistered and unlinked on close,
  a refused call changing nothing;
- against the real CPU server with --allow_client_shm: the same calls over system shm
  give the bytes path's O exactly, a region unregistered between calls and a span outside
  its region are refused naming it and change nothing (skipped while the server has no
  SharedMemory service: UNIMPLEMENTED);
- CUDA IPC regions with torch CUDA tensors against a CUDA server ($ATTNSERVE_TARGET on
  the GPU machine; skipped without a GPU or with a CPU server).
"""

from __future__ import annotations

import glob
import mmap
import os
import subprocess
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest

import reference
from attnserve import AttnServeError, Client
from attnserve import shm as shm_mod
from attnserve.kv import Cache
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import kv_pb2, kv_pb2_grpc, shm_pb2, shm_pb2_grpc
from conftest import Server, _binary

LAYERS, HQ, HKV, D = 2, 4, 2, 32


def rand(rng, shape):
    return rng.standard_normal(shape, dtype=np.float32)


def our_objects():
    """This process's POSIX shm objects (attnserve.shm names them py-<pid>-...)."""
    return glob.glob(f"/dev/shm/attnserve.*.py-{os.getpid()}-*")


# -- a stand-in server ---------------------------------------------------------------
class StandIn(shm_pb2_grpc.SharedMemoryServicer, kv_pb2_grpc.KvCacheServicer):
    """SharedMemory over POSIX objects and the K/V calls of one FP32 cache, in Python."""

    def __init__(self):
        self.regions = {}  # name -> (key, mmap)
        self.history = {}  # (sequence, layer) -> (k rows, v rows)
        self.requests = []  # the AppendAttend requests as received
        self.lock = threading.Lock()

    def Register(self, request, context):
        if request.name in self.regions:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"name: {request.name} in use")
        key = request.system.key
        if not key.startswith("/attnserve.default."):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"system.key: {key}")
        fd = os.open("/dev/shm/" + key[1:], os.O_RDWR)
        try:
            self.regions[request.name] = (key, mmap.mmap(fd, request.byte_size))
        finally:
            os.close(fd)
        return shm_pb2.RegisterRegionResponse()

    def Unregister(self, request, context):
        entry = self.regions.pop(request.name, None)
        if entry is not None:
            entry[1].close()
        return shm_pb2.UnregisterRegionResponse()

    def Status(self, request, context):
        return shm_pb2.RegionStatusResponse(regions=[
            shm_pb2.RegionStatus(name=n, system=shm_pb2.SystemRegion(key=k),
                                 byte_size=len(m)) for n, (k, m) in self.regions.items()])

    def CreateCache(self, request, context):
        return kv_pb2.CreateCacheResponse(stats=kv_pb2.CacheStats(
            cache_id=request.cache_id, geometry=request.geometry, page_size=16))

    def DropCache(self, request, context):
        return kv_pb2.DropCacheResponse()

    def CreateSequences(self, request, context):
        return kv_pb2.CreateSequencesResponse()

    def FreeSequences(self, request, context):
        return kv_pb2.FreeSequencesResponse()

    def _span(self, field, t, shape, context):
        span = t.shm
        entry = self.regions.get(span.region)
        nbytes = int(np.prod(shape)) * 4
        if entry is None or span.offset + span.byte_size > len(entry[1]) or \
                span.byte_size != nbytes or t.data:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{field}.shm: {span.region} "
                          f"[{span.offset}, +{span.byte_size})")
        return entry[1], span.offset

    def AppendAttend(self, request, context):
        self.requests.append(request)
        q_map, q_at = self._span("q", request.q, request.q.shape, context)
        k_map, k_at = self._span("k", request.k, request.k.shape, context)
        v_map, v_at = self._span("v", request.v, request.v.shape, context)
        o_map, o_at = self._span("output_shm.o", pb.Tensor(shm=request.output_shm.o),
                                 request.q.shape, context)
        read = lambda m, at, shape: np.frombuffer(m, np.float32, int(np.prod(shape)),
                                                  at).reshape(shape).copy()
        q = read(q_map, q_at, request.q.shape)
        k = read(k_map, k_at, request.k.shape)
        v = read(v_map, v_at, request.v.shape)
        out = np.empty_like(q)
        lengths, qi, ki = [], 0, 0
        with self.lock:
            for step in request.sequences:
                key = (step.sequence_id, request.layer)
                hk, hv = self.history.get(key, (k[:0], v[:0]))
                if len(hk) != step.expected_length:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, "expected_length")
                hk = np.concatenate([hk, k[ki:ki + step.num_new_tokens]])
                hv = np.concatenate([hv, v[ki:ki + step.num_new_tokens]])
                self.history[key] = (hk, hv)
                o, _ = reference.attention(q[None, qi:qi + step.num_queries], hk[None], hv[None],
                                           causal=True)
                out[qi:qi + step.num_queries] = o[0]
                lengths.append(len(hk))
                qi += step.num_queries
                ki += step.num_new_tokens
        o_map[o_at:o_at + out.nbytes] = out.tobytes()
        return kv_pb2.AppendAttendResponse(
            request_id=request.request_id, lengths=lengths, backend="cpu",
            o=pb.Tensor(dtype=pb.FP32, shape=request.q.shape, shm=request.output_shm.o))


@pytest.fixture
def stand_in():
    servicer = StandIn()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    shm_pb2_grpc.add_SharedMemoryServicer_to_server(servicer, server)
    kv_pb2_grpc.add_KvCacheServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with Client(f"127.0.0.1:{port}", max_attempts=1) as client:
        yield servicer, client
    server.stop(None)


def test_append_attend_through_system_shm_on_a_stand_in(stand_in):
    servicer, client = stand_in
    rng = np.random.default_rng(1)
    history = {}
    with Cache(client, num_layers=LAYERS, num_heads_kv=HKV, head_dim=D, dtype="float32",
               capacity_tokens=1 << 12) as cache, cache.sequences(2) as seqs:
        for step, n in enumerate((5, 1, 1)):  # prefill 5, then two decode steps
            for layer in range(LAYERS):
                q, k, v = rand(rng, (2, n, HQ, D)), rand(rng, (2, n, HKV, D)), \
                    rand(rng, (2, n, HKV, D))
                o = cache.append_attend(layer, seqs, q, k, v, shm=True)
                for b in range(2):
                    hk, hv = history.get((b, layer), (k[b, :0], v[b, :0]))
                    history[b, layer] = (np.concatenate([hk, k[b]]), np.concatenate([hv, v[b]]))
                    want, _ = reference.attention(q[b][None], history[b, layer][0][None],
                                                  history[b, layer][1][None], causal=True)
                    np.testing.assert_allclose(o[b], want[0], atol=1e-5)
        assert [s.lengths for s in seqs] == [[7, 7]] * 2
        # Nothing of the tensors travelled in the messages; one region served every call.
        sent = servicer.requests[-1]
        assert not sent.q.data and not sent.k.data and not sent.v.data
        assert sent.q.HasField("shm") and sent.output_shm.o.region == sent.q.shm.region
        assert len(servicer.regions) == 1
        (key, _), = servicer.regions.values()
        assert key.startswith("/attnserve.default.py-") and our_objects()
    # Closing the cache unregistered the region and unlinked its object.
    assert servicer.regions == {} and our_objects() == []


def test_a_refused_shm_call_changes_nothing_and_frees_its_span(stand_in):
    servicer, client = stand_in
    rng = np.random.default_rng(2)
    with Cache(client, num_layers=LAYERS, num_heads_kv=HKV, head_dim=D, dtype="float32",
               capacity_tokens=1 << 12) as cache, cache.sequence() as seq:
        q, k, v = rand(rng, (3, HQ, D)), rand(rng, (3, HKV, D)), rand(rng, (3, HKV, D))
        cache.append_attend(0, [seq], q, k, v, shm=True)
        # The region is gone on the server (unregistered behind the client's back).
        (name,) = servicer.regions
        servicer.Unregister(shm_pb2.UnregisterRegionRequest(name=name), None)
        with pytest.raises(AttnServeError) as e:
            cache.append_attend(0, [seq], q[:1], k[:1], v[:1], shm=True)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and name in e.value.message
        assert seq.lengths == [3, 0]  # rolled back
        pool, = cache._shm_pools.values()
        assert pool._lent == [] and len(pool._free) == 1  # the lease went back
    assert our_objects() == []


def test_regions_grow_and_are_shared_by_calls_in_flight(stand_in):
    servicer, client = stand_in
    rng = np.random.default_rng(3)
    with Cache(client, num_layers=1, num_heads_kv=HKV, head_dim=D, dtype="float32",
               capacity_tokens=1 << 16) as cache, cache.sequences(4) as seqs:
        pool = cache._shm_pool("system", None)
        # Calls from four threads at once: each leases its own region.
        def call(i):
            n = 800 if i == 0 else 8  # the first needs more than the pool's first size
            x = rand(rng, (n, HQ, D)), rand(rng, (n, HKV, D)), rand(rng, (n, HKV, D))
            return cache.append_attend(0, [seqs[i]], *x, shm="system")
        with futures.ThreadPoolExecutor(4) as ex:
            outs = list(ex.map(call, range(4)))
        assert [o.shape[0] for o in outs] == [800, 8, 8, 8]
        assert pool._lent == [] and 1 <= len(pool._free) <= 4
        assert max(r.byte_size for r in pool._free) >= 800 * (2 * HQ + 2 * HKV) * D * 4
    assert servicer.regions == {} and our_objects() == []


def test_a_region_by_hand_and_the_key_rule(stand_in):
    servicer, client = stand_in
    with shm_mod.SystemRegion(client, 4096, name="mine") as region:
        assert region.key == "/attnserve.default.mine" and "mine" in servicer.regions
        off = region.alloc(100)
        assert off == 0 and region.alloc(1) == shm_mod.ALIGNMENT
        x = np.arange(25, dtype=np.float32)
        region.write(off, x)
        np.testing.assert_array_equal(region.read(off, np.float32, (25,)), x)
        with pytest.raises(AttnServeError) as e:
            region.alloc(4096)
        assert "do not fit" in e.value.message
    assert servicer.regions == {} and not os.path.exists("/dev/shm/attnserve.default.mine")
    # Another tenant's prefix is refused by the server; nothing is left behind.
    with pytest.raises(AttnServeError) as e:
        shm_mod.SystemRegion(client, 4096, tenant="other")
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and our_objects() == []
    with pytest.raises(AttnServeError):
        shm_mod.kind_for(client, "gpu", np.zeros(1))


# -- the real server -------------------------------------------------------------------
@pytest.fixture(scope="module")
def shm_server():
    target = os.environ.get("ATTNSERVE_TARGET", "")
    if target:  # a server someone else started (the GPU machine's run): it has the flag
        yield type("Running", (), {"target": target})()
        return
    s = Server(_binary(), ["--allow_client_shm"])
    yield s
    s.stop()


@pytest.fixture
def shm_client(shm_server):
    with Client(shm_server.target) as c:
        try:
            with shm_mod.SystemRegion(c, 4096):
                pass
        except AttnServeError as e:
            if e.code == grpc.StatusCode.UNIMPLEMENTED:
                pytest.skip("this server has no SharedMemory service (shm.proto)")
            raise
        yield c


def test_system_shm_gives_the_bytes_paths_o(shm_client):
    rng = np.random.default_rng(4)
    with Cache(shm_client, num_layers=LAYERS, num_heads_kv=HKV, head_dim=D, dtype="float32",
               capacity_tokens=1 << 12) as a, a.sequences(2) as sa, \
            Cache(shm_client, num_layers=LAYERS, num_heads_kv=HKV, head_dim=D,
                  dtype="float32", capacity_tokens=1 << 12, shm=True) as b, \
            b.sequences(2) as sb:
        for n in (6, 1, 1):
            for layer in range(LAYERS):
                q, k, v = rand(rng, (2, n, HQ, D)), rand(rng, (2, n, HKV, D)), \
                    rand(rng, (2, n, HKV, D))
                want = a.append_attend(layer, sa, q, k, v)
                got = b.append_attend(layer, sb, q, k, v)
                np.testing.assert_array_equal(got, want)
        # And on a stream, several calls in flight (each leases its own span).
        with a.stream() as s1, b.stream() as s2:
            pairs = []
            for layer in range(LAYERS):
                q, k, v = rand(rng, (2, 1, HQ, D)), rand(rng, (2, 1, HKV, D)), \
                    rand(rng, (2, 1, HKV, D))
                pairs.append((s1.submit(layer, sa, q, k, v), s2.submit(layer, sb, q, k, v)))
            for f1, f2 in pairs:
                np.testing.assert_array_equal(f2.result(timeout=60).o, f1.result(timeout=60).o)
        assert b.server_lengths(sb) == a.server_lengths(sa)
    assert our_objects() == []


def test_an_unregistered_region_and_a_bad_span_change_nothing(shm_client):
    rng = np.random.default_rng(5)
    with Cache(shm_client, num_layers=1, num_heads_kv=HKV, head_dim=D, dtype="float32",
               capacity_tokens=1 << 12, shm="system") as cache, cache.sequence() as seq:
        q, k, v = rand(rng, (4, HQ, D)), rand(rng, (4, HKV, D)), rand(rng, (4, HKV, D))
        cache.append_attend(0, [seq], q, k, v)
        pool, = cache._shm_pools.values()
        region, = pool._free
        stub = shm_pb2_grpc.SharedMemoryStub(shm_client.channel)
        stub.Unregister(shm_pb2.UnregisterRegionRequest(name=region.name))
        region._registered = False  # the client's own close must not unregister it twice
        with pytest.raises(AttnServeError) as e:
            cache.append_attend(0, [seq], q[:1], k[:1], v[:1])
        assert region.name in e.value.message, e.value.message
        assert seq.lengths == [4] and cache.server_lengths([seq]) == {seq.id: [4]}
        # A span past the end of a registered region: refused naming the field.
        with shm_mod.SystemRegion(shm_client, 4096) as small:
            req = kv_pb2.AppendAttendRequest(request_id="bad-span", cache_id=cache.cache_id,
                                             layer=0)
            req.sequences.add(sequence_id=seq.id, expected_length=4, num_new_tokens=1,
                              num_queries=1)
            for name, heads in (("q", HQ), ("k", HKV), ("v", HKV)):
                t = getattr(req, name)
                t.dtype = pb.FP32
                t.shape.extend((1, heads, D))
                t.shm.CopyFrom(small.span(4096 - 256, heads * D * 4))  # aligned, past the end
            with pytest.raises(grpc.RpcError) as e:
                kv_pb2_grpc.KvCacheStub(shm_client.channel).AppendAttend(
                    req, metadata=cache._metadata)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "shm" in e.value.details(), e.value.details()
        assert cache.server_lengths([seq]) == {seq.id: [4]}
    assert our_objects() == []


def test_without_allow_client_shm_register_is_refused_and_nothing_is_left():
    if os.environ.get("ATTNSERVE_TARGET"):
        pytest.skip("needs a server of its own")
    s = Server(_binary(), [])
    try:
        with Client(s.target) as c:
            with pytest.raises(AttnServeError) as e:
                shm_mod.SystemRegion(c, 4096)
            if e.value.code == grpc.StatusCode.UNIMPLEMENTED:
                pytest.skip("this server has no SharedMemory service (shm.proto)")
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert our_objects() == []
    finally:
        s.stop()


# -- CUDA IPC --------------------------------------------------------------------------
@pytest.fixture(scope="module")  # module scope: set up before shm_server, so no server starts
def torch_gpu():
    """torch with a GPU, or the test is skipped."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    return torch


def test_cuda_tensors_through_cuda_ipc(torch_gpu, shm_client):
    torch = torch_gpu
    if shm_mod.server_backend(shm_client) != "cuda":
        pytest.skip("the server's backend is not CUDA")
    rng = np.random.default_rng(6)
    dev = torch.device("cuda", 0)
    with Cache(shm_client, num_layers=1, num_heads_kv=HKV, head_dim=D, dtype=torch.float16,
               capacity_tokens=1 << 12) as a, a.sequence() as sa, \
            Cache(shm_client, num_layers=1, num_heads_kv=HKV, head_dim=D, dtype=torch.float16,
                  capacity_tokens=1 << 12, shm=True) as b, b.sequence() as sb:
        for n in (9, 1, 1):
            q, k, v = (torch.from_numpy(rand(rng, (n, h, D))).half().to(dev)
                       for h in (HQ, HKV, HKV))
            want = a.append_attend(0, [sa], q, k, v)
            got = b.append_attend(0, [sb], q, k, v)
            assert got.device == dev and got.dtype == torch.float16
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert list(b._shm_pools) == [("cuda", "cuda:0")]


def test_the_ipc_handle_and_offset_agree_with_torchs_export(torch_gpu):
    torch = torch_gpu
    dev = torch.device("cuda", 0)
    # Two tensors in one caching-allocator segment: the second starts inside it.
    a = torch.empty(3 << 20, dtype=torch.uint8, device=dev)
    b = torch.empty(3 << 20, dtype=torch.uint8, device=dev)
    for t in (a, b, b[4096:]):
        handle, offset = shm_mod.ipc_handle(t)
        want_handle, want_offset = shm_mod._torch_ipc_handle(t)
        assert len(handle) == shm_mod.CUDA_IPC_HANDLE_BYTES == len(want_handle)
        assert offset == want_offset, (offset, want_offset)
    assert shm_mod.ipc_handle(b[4096:])[1] == shm_mod.ipc_handle(b)[1] + 4096


def test_torchs_exported_handle_forms():
    """torch's export: a raw 64-byte handle (old torch) or version + type + handle (66)."""
    raw = bytes(range(64))

    class Storage:
        def __init__(self, handle):
            self.handle = handle

        def _share_cuda_(self):
            return (0, self.handle, 1 << 20, 512, None)

    class Tensor:
        def __init__(self, handle):
            self.storage = Storage(handle)

        def untyped_storage(self):
            return self.storage

        def storage_offset(self):
            return 8

        def element_size(self):
            return 2

    assert shm_mod._torch_ipc_handle(Tensor(raw)) == (raw, 512 + 16)
    assert shm_mod._torch_ipc_handle(Tensor(b"\x02c" + raw)) == (raw, 512 + 16)
    assert shm_mod._torch_ipc_handle(Tensor(b"\x03c" + raw)) == (raw, 512 + 16)
    with pytest.raises(AttnServeError) as e:
        shm_mod._torch_ipc_handle(Tensor(b"\x02e" + raw + b"more"))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "expandable_segments" in e.value.message
