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
mask, when the layer's pattern is plain causal or causal within a sliding
window (attnserve_mask decides). A padded batch is unpadded into the packed
varlen layout with cu_seqlens, so no mask goes on the wire and padded rows
cost nothing; the result is scattered back, padded query rows set to 0.

Other masks go on the wire as the whole truth (causal=False, no window):
  a 4-D mask given to the model (transformers passes it through unchanged):
    boolean, True = attend, sent as `mask=`; or additive float, eager's
    convention, converted by additive_mask: -inf and entries at or below half
    the dtype's lowest finite value (transformers fills masked entries with
    torch.finfo(dtype).min) remove the key, sent as `mask=`; every other
    entry, when any is nonzero, is sent as `bias=`;
  any other pattern transformers builds (packed sequences found from
    position_ids, or_mask_function/and_mask_function overlays, chunked or
    bidirectional attention): attnserve_mask materializes it as sdpa's
    boolean [B, 1, Sq, Sk] mask.
A query row that sees no key gets O = 0 (docs/masks.md), where eager spreads
it evenly over the masked keys: such rows are padding, whose outputs nothing
reads.

Attention sinks (gpt-oss passes its per-head logits as `s_aux`) go as
`sinks=`: one logit per head in the softmax denominator, eager's contract,
in both modes (with K/V on the server, on the append-and-attend call, as are
sliding windows). With K/V on the server a 4-D mask goes on the append-and-attend
call the same way (its key columns are each sequence's whole history: every row's
sequence must hold exactly the mask's Sk tokens after the append, so no padding
beside it).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import (AttentionMaskInterface, causal_mask_function,
                                        flash_attention_mask, sdpa_mask)

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
    AttentionMaskInterface.register(name, attnserve_mask)
    return _client


def cu_seqlens(mask: torch.Tensor) -> torch.Tensor:
    """B+1 int32 offsets of the packed layout of a [B, S] boolean mask."""
    return F.pad(torch.cumsum(mask.sum(dim=-1, dtype=torch.int32), dim=0, dtype=torch.int32),
                 (1, 0))


def _is_plain(mask_function: Callable, local_size: Optional[int]) -> bool:
    """Whether mask_function is exactly causal (local_size None) or causal within
    transformers' sliding window of local_size (key j > query i - local_size):
    the patterns attention_forward sends as causal and window. Probed on two
    query rows across the window's edges, as sdpa_mask evaluates it (index tensors)."""
    n = 2 * local_size + 2 if local_size else 4
    q_idx = torch.tensor([[n], [n + 1]])
    kv_idx = torch.arange(n + 3)[None, :]
    want = kv_idx <= q_idx
    if local_size:
        want &= kv_idx > q_idx - local_size
    zero = torch.zeros((), dtype=torch.long)
    try:
        got = mask_function(zero, zero, q_idx, kv_idx)
    except Exception:  # not index-based: materialize it
        return False
    return isinstance(got, torch.Tensor) and got.shape == want.shape and bool((got == want).all())


def attnserve_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                   kv_offset: int = 0, mask_function: Callable = causal_mask_function,
                   attention_mask: Optional[torch.Tensor] = None,
                   allow_is_causal_skip: bool = True, local_size: Optional[int] = None,
                   **kwargs: Any) -> Optional[torch.Tensor]:
    """The mask transformers hands the "attnserve" attention function (AttentionMaskInterface).

    Plain causal or sliding-window causal patterns (transformers allows skipping
    their mask): the 2-D padding mask or None, as for FlashAttention-2, which
    attention_forward unpads. Anything else (transformers sets
    allow_is_causal_skip=False for packed sequences, mask overlays and
    bidirectional masks; chunked attention fails the probe): sdpa's boolean
    [B, 1, Sq, Sk] mask, which attention_forward sends as it is.
    """
    if allow_is_causal_skip and _is_plain(mask_function, local_size):
        return flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                                    mask_function, attention_mask)
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                     attention_mask=attention_mask, allow_is_causal_skip=False,
                     allow_is_bidirectional_skip=False, use_vmap=kwargs.get("use_vmap", False),
                     device=kwargs.get("device", "cpu"))


def additive_mask(mask: torch.Tensor) -> Dict[str, torch.Tensor]:
    """A 4-D mask as forward()'s `mask=` and `bias=` arguments.

    Boolean: True = attend, sent as it is. Float (eager's additive convention):
    -inf and entries <= torch.finfo(dtype).min / 2 remove the key (`mask=`, sent
    only if something is removed, one head's if all heads agree); the other entries are
    added to the scores
    (`bias=`, sent only if one is nonzero, with removed entries as 0). NaN is
    left in the bias, where the server refuses it naming options.bias.
    """
    if mask.dtype == torch.bool:
        return {"mask": mask}
    if not mask.is_floating_point():
        raise ValueError(f"attnserve.hf: a 4-D attention mask is boolean (True = attend) or "
                         f"additive float, got dtype {mask.dtype}")
    removed = mask <= torch.finfo(mask.dtype).min / 2
    if removed.shape[1] > 1 and bool((removed == removed[:, :1]).all()):
        removed_any_head = removed[:, :1]  # the same keys removed for every head: send one
    else:
        removed_any_head = removed
    out: Dict[str, torch.Tensor] = {}
    if removed.any():
        out["mask"] = ~removed_any_head
    bias = mask.masked_fill(removed, 0)
    if bias.any():
        out["bias"] = bias
    return out


# The last 4-D mask converted on this thread: every layer of a forward gets the same tensor.
_converted = threading.local()


def _converted_mask(mask: torch.Tensor) -> Dict[str, torch.Tensor]:
    last = getattr(_converted, "last", None)
    if last is not None and last[0]() is mask and last[1] == mask._version:
        return last[2]
    out = additive_mask(mask)
    _converted.last = (weakref.ref(mask), mask._version, out)
    return out


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, **kwargs: Any
                      ) -> Tuple[torch.Tensor, None]:
    """transformers' attention function signature.

    query [B, Hq, Sq, D], key/value [B, Hkv, Sk, D] (GQA heads not repeated);
    attention_mask: None, the 2-D padding mask [B, Sk] (True = a real token),
    or a 4-D mask [B or 1, Hq or 1, Sq, Sk] (boolean or additive float);
    s_aux (kwargs): gpt-oss's sinks, [Hq] logits.
    Returns (attn_output [B, Sq, Hq, D], None): no attention weights.
    """
    if module.training and dropout > 0:
        raise NotImplementedError("attnserve.hf: attention dropout (the server is forward-only)")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("attnserve.hf: position_bias")
    if attention_mask is not None and attention_mask.dim() not in (2, 4):
        raise ValueError("attnserve.hf: expected the 2-D padding mask [B, Sk] or a 4-D mask "
                         f"[B, 1 or Hq, Sq, Sk], got a mask of shape "
                         f"{tuple(attention_mask.shape)}")
    full_mask = attention_mask is not None and attention_mask.dim() == 4
    sinks = kwargs.get("s_aux")
    causal = bool(module.is_causal if is_causal is None else is_causal)
    options = dict(causal=causal, scale=scaling, softcap=softcap or 0.0,
                   # FlashAttention-2's mapping of transformers' sliding_window.
                   window=None if sliding_window is None else (sliding_window - 1, sliding_window - 1))
    if sinks is not None:
        options["sinks"] = sinks
    from attnserve import hf_cache  # not at the top: hf_cache imports this module
    layer = hf_cache.take_pending(key)
    if layer is not None:  # K/V on the server: this call's new tokens only
        if full_mask:  # the whole pattern, over each sequence's history after the append
            options.update(causal=False, window=None, **_converted_mask(attention_mask))
            return layer.attend(query, key, value, None, options), None
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
    if full_mask:  # the mask is the whole pattern: no causal band, no window
        if attention_mask.shape[-2:] != (q_len, k.shape[1]):
            raise ValueError(f"attnserve.hf: the 4-D mask's last dimensions "
                             f"{tuple(attention_mask.shape[-2:])} must be (Sq, Sk) = "
                             f"({q_len}, {k.shape[1]})")
        options.update(causal=False, window=None, **_converted_mask(attention_mask))
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
