"""attnserve: the Python client of the attnserve attention service.

    from attnserve import Client
    with Client("127.0.0.1:50051") as client:
        o = client.forward(q, k, v, causal=True)

Public API:
  Client, ForwardStream         synchronous client (attnserve.client)
  AsyncClient, AsyncForwardStream   asyncio client (attnserve.aio)
  AttnServeError                the one exception: .code (grpc.StatusCode), .message
  ForwardResult, ServerTiming   what forward_result()/echo()/streams return
  attnserve.masks               BlockMask (from_dense, from_flex), alibi_slopes, mask patterns
  attnserve.kv                  K/V on the server: Cache, Sequence(s), append_attend, streams
  attnserve.kv_aio              AsyncCache, AsyncAppendAttendStream: the K/V API for asyncio
  attnserve.hf                  the transformers attention implementation ("attnserve")
  attnserve.hf_cache            ServerCache: a transformers Cache with K/V on the server
  attnserve.hf_compare          greedy tokens through attnserve vs transformers' "sdpa":
                                the first differing step and the logit margins there
  merge_partials                the exact log-sum-exp merge of partial results over disjoint
                                keys (attnserve.merge: context parallelism across servers)
  attnserve.transfer            moving K/V sequences between servers: move_cache,
                                export_sequences, import_sequences, chunk files
  attnserve.v1                  the generated stubs (attention_pb2(_grpc), kv_pb2(_grpc),
                                kv_transfer_pb2(_grpc))
See docs/python.md.
"""

from attnserve._request import ForwardResult, ServerTiming
from attnserve.aio import AsyncClient, AsyncForwardStream
from attnserve.client import Client, ForwardStream
from attnserve.errors import AttnServeError
from attnserve.merge import merge_partials

__all__ = ["Client", "ForwardStream", "AsyncClient", "AsyncForwardStream", "AttnServeError",
           "ForwardResult", "ServerTiming", "merge_partials"]
__version__ = "0.1.0"
