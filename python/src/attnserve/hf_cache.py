"""A transformers Cache whose K/V live in an attnserve K/V cache: generate() sends only new tokens.

    import attnserve.hf
    from attnserve.hf_cache import ServerCache
    client = attnserve.hf.register("127.0.0.1:50051")
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attnserve")
    with ServerCache(client, max_tokens=ids.shape[1] + 64) as cache:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=64,
                             past_key_values=cache)

How it works: transformers' attention layers call `past_key_values.update(k,
v, layer)` with the new tokens' K/V and then the attention function with those
same tensors. ServerCache.update keeps nothing on the client: it notes the new
K/V as this thread's pending call and returns them unchanged; the "attnserve"
attention function (attnserve.hf) finds the note and makes one
append-and-attend call for the layer with the new K/V and Q. So each step
sends O(new tokens) bytes, not the whole history.

Batches: row b of the batch is sequence b of the attnserve cache (created on
the first call, when the batch size is known). The padding mask says which
new positions are real tokens: only those are appended and queried, packed
(varlen) as in attnserve.hf, so a left-padded row's sequence holds exactly its
real tokens and padding costs nothing. transformers still counts padded
columns (get_seq_length is the padded width), as with its own caches.

A custom 4-D mask given to the model goes on each append-and-attend call
(attnserve.hf): its key columns are each row's whole history, so every row's
sequence must hold exactly Sk tokens after the append (no 2-D padding mask in
the same generation).

Not supported (NotImplementedError): beam search (reorder_cache,
batch_select_indices), crop (assisted decoding), a batch that changes size.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional, Tuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from attnserve import hf, kv
from attnserve.client import Client

# Room for page rounding per (sequence, layer): a sequence's last page is
# partial, and pages are at most 256 tokens (kv.proto).
_MAX_PAGE_SIZE = 256

_pending = threading.local()


def take_pending(key: torch.Tensor) -> Optional["ServerLayer"]:
    """The layer whose update() just received `key` on this thread, if any (once)."""
    layer = getattr(_pending, "layer", None)
    if layer is None or getattr(_pending, "key", None) is not key:
        return None
    _pending.layer = _pending.key = None
    return layer


class ServerLayer(CacheLayerMixin):
    """One model layer of a ServerCache: counts columns; the K/V are on the server."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner: "ServerCache", index: int):
        super().__init__()
        self.owner = owner
        self.index = index
        self.columns = 0  # padded positions seen, as transformers counts them

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        left = getattr(_pending, "layer", None)
        if left is not None:  # the attention function never took the last layer's K/V
            _pending.layer = _pending.key = None
            raise RuntimeError(
                f"attnserve.hf_cache: layer {left.index}'s new K/V were not sent to the server: "
                "a ServerCache needs the model's attn_implementation=\"attnserve\" "
                "(attnserve.hf.register)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.owner._ensure(key_states)
        self.columns += key_states.shape[-2]
        _pending.layer, _pending.key = self, key_states
        return key_states, value_states

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], options: Dict[str, Any]) -> torch.Tensor:
        """Appends the real new tokens of each row to its sequence and attends their
        queries (query [B, Hq, Sq, D], key/value [B, Hkv, Sq, D], the 2-D padding
        mask or None; a 4-D mask comes in `options` as mask= and bias=, its columns
        each row's whole history). Returns [B, Sq, Hq, D], padded query rows 0."""
        batch, _, q_len, _ = query.shape
        if key.shape[2] != q_len:
            raise ValueError(f"attnserve.hf_cache: expected as many new keys as queries, got "
                             f"{key.shape[2]} keys and {q_len} queries")
        q = query.transpose(1, 2)  # [B, Sq, H, D] views
        k = key.transpose(1, 2)
        v = value.transpose(1, 2)
        if attention_mask is None:  # nothing padded: every row's new tokens are real
            return self.owner.cache.append_attend(self.index, self.owner.sequences, q, k, v,
                                                  **options)
        real = attention_mask[:, -q_len:].bool()  # which new positions are tokens
        rows = real.any(dim=1).nonzero().flatten().tolist()
        sequences = [self.owner.sequences[b] for b in rows]
        real_rows = real[rows]
        cu = hf.cu_seqlens(real_rows)
        select = torch.zeros_like(real)
        select[rows] = real_rows
        o = self.owner.cache.append_attend(self.index, sequences, q[select], k[select], v[select],
                                           cu_seqlens_q=cu, cu_seqlens_k=cu, **options)
        out = torch.zeros((batch, q_len, *o.shape[1:]), dtype=o.dtype, device=o.device)
        out[select.to(out.device)] = o
        return out

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self.columns + query_length, 0

    def get_seq_length(self) -> int:
        return self.columns

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Empties this layer of every sequence (Cache.reset calls each layer)."""
        for seq in self.owner.sequences or ():
            seq.truncate(0, layer=self.index)
        self.columns = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("attnserve.hf_cache: beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("attnserve.hf_cache: crop")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("attnserve.hf_cache: batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("attnserve.hf_cache: batch_select_indices")


class ServerCache(Cache):
    """transformers Cache whose K/V are in an attnserve cache (one sequence per batch row).

    Args:
      client: the attnserve.Client to use.
      config: the model's config (for num_hidden_layers); or pass num_layers.
      max_tokens: the most tokens (prompt + generated, padding excluded) one
        row will hold; sizes the server cache's capacity.
      page_size: tokens per page on the server (0 = the server's default).
      device: the server device (None = the server's choice).
      timeout: deadline of each call (None = the client's).

    The attnserve cache is created on the first forward (its geometry and dtype
    are the model's K/V) and dropped by close(); use it as a context manager.
    One ServerCache serves one generate() call.
    """

    def __init__(self, client: Client, config: Any = None, *, num_layers: Optional[int] = None,
                 max_tokens: int = 4096, page_size: int = 0, device: Optional[int] = None,
                 timeout: Optional[float] = None):
        if num_layers is None:
            if config is None:
                raise ValueError("attnserve.hf_cache: give the model's config or num_layers")
            num_layers = config.get_text_config().num_hidden_layers
        super().__init__(layers=[ServerLayer(self, i) for i in range(num_layers)])
        self.client = client
        self.max_tokens = max_tokens
        self.page_size = page_size
        self.server_device = device
        self.timeout = timeout
        self.cache: Optional[kv.Cache] = None
        self.sequences: Optional[kv.Sequences] = None

    def _ensure(self, key_states: torch.Tensor) -> None:
        """Creates the attnserve cache and one sequence per row on the first call."""
        batch, heads_kv, _, head_dim = key_states.shape
        if self.cache is None:
            capacity = batch * len(self.layers) * (self.max_tokens + _MAX_PAGE_SIZE)
            self.cache = kv.Cache(self.client, num_layers=len(self.layers),
                                  num_heads_kv=heads_kv, head_dim=head_dim,
                                  dtype=key_states.dtype, capacity_tokens=capacity,
                                  page_size=self.page_size, device=self.server_device,
                                  timeout=self.timeout)
            self.sequences = self.cache.sequences(batch)
        elif batch != len(self.sequences):
            raise NotImplementedError(f"attnserve.hf_cache: the batch changed from "
                                      f"{len(self.sequences)} to {batch} rows")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def close(self) -> None:
        """Drops the attnserve cache (all its sequences); idempotent."""
        if self.cache is not None:
            self.cache.close()

    def __enter__(self) -> "ServerCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
