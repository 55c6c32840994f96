"""Hugging Face transformers integration: every attention call of a model runs on attnserve.

    import attnserve.hf
    attnserve.hf.register("127.0.0.1:50051")       # or an attnserve.Client
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attnserve")
    model.generate(input_ids, attention_mask=mask, max_new_tokens=64)

register() adds "attnserve" to transformers' AttentionInterface (the attention
function) and AttentionMaskInterface (the mask it receives). Two modes:
  stateless (default): each call sends the layer's whole Q, K and V
    (transformers' own cache keeps K/V in the client process);
  K/V on the server: pass `past_key_values=attnserve.hf_cache.ServerCache(...)`
    to generate(); each call then sends only the new tokens' Q, K and V
    (attnserve.hf_cache).

Padding: like transformers' FlashAttention-2 path, the model hands us the 2-D
padding mask [B, Sk] (None when nothing is padded) instead of a 4-D additive
mask. A padded batch is unpadded into the packed varlen layout with
cu_seqlens, so no mask goes on the wire and padded rows cost nothing; the
result is scattered back, padded query rows set to 0.
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from attnserve.client import Client

NAME = "attnserve"

_lock = threading.Lock()
_client: Optional[Client] = None


def register(client: Union[Client, str], name: str = NAME) -> Client:
    """Registers the attention implementation `name` that calls `client` (or a new Client(target))."""
    global _client
    with _lock:
        _client = client if isinstance(client, Client) else Client(client)
    AttentionInterface.register(name, attention_forward)
    # The 2-D padding mask (or None), as for FlashAttention-2: we unpad it ourselves.
    AttentionMaskInterface.register(name, flash_attention_mask)
    return _client


def cu_seqlens(mask: torch.Tensor) -> torch.Tensor:
    """B+1 int32 offsets of the packed layout of a [B, S] boolean mask."""
    return F.pad(torch.cumsum(mask.sum(dim=-1, dtype=torch.int32), dim=0, dtype=torch.int32),
                 (1, 0))


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, **kwargs: Any
                      ) -> Tuple[torch.Tensor, None]:
    """transformers' attention function signature.

    query [B, Hq, Sq, D], key/value [B, Hkv, Sk, D] (GQA heads not repeated);
    attention_mask: None or the 2-D padding mask [B, Sk] (True = a real token).
    Returns (attn_output [B, Sq, Hq, D], None): no attention weights.
    """
    if module.training and dropout > 0:
        raise NotImplementedError("attnserve.hf: attention dropout (the server is forward-only)")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attnserve.hf: attention sinks (s_aux)")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError("attnserve.hf: expected the 2-D padding mask [B, Sk] registered by "
                         f"attnserve.hf.register, got a mask of shape {tuple(attention_mask.shape)}")
    causal = bool(module.is_causal if is_causal is None else is_causal)
    options = dict(causal=causal, scale=scaling, softcap=softcap or 0.0,
                   # FlashAttention-2's mapping of transformers' sliding_window.
                   window=None if sliding_window is None else (sliding_window - 1, sliding_window - 1))
    from attnserve import hf_cache  # not at the top: hf_cache imports this module
    layer = hf_cache.take_pending(key)
    if layer is not None:  # K/V on the server: this call's new tokens only
        return layer.attend(query, key, value, attention_mask, options), None
    client = _client
    if client is None:
        raise RuntimeError("attnserve.hf: call attnserve.hf.register(target) first")
    batch, _, q_len, _ = query.shape
    q = query.transpose(1, 2)  # [B, Sq, Hq, D] views; the client copies once into bytes
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    if attention_mask is None:
        return client.forward(q, k, v, **options), None

    # Padded batch -> packed varlen, as transformers' _upad_input does. Boolean
    # indexing gathers each of Q, K, V in one copy, contiguous.
    mask = attention_mask.bool()
    mask = mask[:, -k.shape[1]:] if mask.shape[1] > k.shape[1] else mask
    k = k[:, :mask.shape[1]]  # a static cache may hold more slots than the mask covers
    v = v[:, :mask.shape[1]]
    cu_k = cu_seqlens(mask)
    if q_len == mask.shape[1]:  # prefill: the queries are the keys' tokens
        mask_q = mask
    elif q_len == 1:  # decode: one real query per sequence
        mask_q = torch.ones((batch, 1), dtype=torch.bool, device=mask.device)
    else:  # chunked prefill: the last q_len mask columns are the queries (left padding)
        mask_q = mask[:, -q_len:]
    o_packed = client.forward(q[mask_q], k[mask], v[mask], cu_seqlens_q=cu_seqlens(mask_q),
                              cu_seqlens_k=cu_k, **options)
    out = torch.zeros((batch, q_len, *o_packed.shape[1:]), dtype=o_packed.dtype,
                      device=o_packed.device)
    out[mask_q.to(out.device)] = o_packed
    return out, None
