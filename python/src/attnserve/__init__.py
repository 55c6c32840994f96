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
  attnserve.v1                  the generated stubs (attention_pb2(_grpc), kv_pb2(_grpc))
See docs/python.md.
"""

from attnserve._request import ForwardResult, ServerTiming
from attnserve.aio import AsyncClient, AsyncForwardStream
from attnserve.client import Client, ForwardStream
from attnserve.errors import AttnServeError

__all__ = ["Client", "ForwardStream", "AsyncClient", "AsyncForwardStream", "AttnServeError",
           "ForwardResult", "ServerTiming"]
__version__ = "0.1.0"
