"""transformers through attnserve with sinks, sliding windows, custom masks: eager's tokens (FP32).

Random weights from configs (nothing is downloaded), every attention call on
the server, stateless (transformers' own cache holds K/V):
  gpt-oss: a tiny GptOssConfig (sinks, layers alternating sliding_attention
    with a window of 4 and full_attention, MoE), a left-padded batch, greedy
    tokens identical to attn_implementation="eager"; the same model without the
    sinks or without the window on the server gives other logits, so the
    comparison can fail; the same with K/V on the server (ServerCache: sinks and
    windows on the append-and-attend calls).
  custom 4-D masks: a small Llama driven step by step with a 4-D mask (one
    row two packed sequences, block-diagonal causal; one row a prefix-LM,
    bidirectional within its prefix), as eager's additive float, as a boolean
    mask, and as an additive mask with a per-head finite bias: identical greedy
    tokens; the mask does change eager's logits. The same with K/V on the
    server (ServerCache): the mask and bias go on the append-and-attend calls,
    each row's columns its sequence's whole history.
  packed sequences found from position_ids (no mask given): attnserve_mask
    materializes transformers' block-diagonal mask, as eager does.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attnserve.hf  # noqa: E402
from attnserve import Client  # noqa: E402
from attnserve import hf_compare, kv  # noqa: E402
from attnserve.hf_cache import ServerCache  # noqa: E402

NEW_TOKENS = 16
LOGIT_TOLERANCE = 1e-4  # FP32 logits of two exact kernels; a dropped mod moves them by > 1e-2
WINDOW = 4


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # torch's OpenMP threads spin against the other processes of a loaded machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def recorded(server):
    """A registered client whose forward() calls are recorded (their keyword arguments)."""
    client = attnserve.hf.register(Client(server.target, timeout=120))
    calls = []
    original = client.forward
    client.forward = lambda *a, **kw: calls.append(kw) or original(*a, **kw)
    yield client, calls, original
    client.close()


def assert_same(want: torch.Tensor, got: torch.Tensor, want_logits: torch.Tensor,
                got_logits: torch.Tensor) -> None:
    assert torch.equal(want, got), (f"tokens differ:\neager     {want.tolist()}\n"
                                    f"attnserve {got.tolist()}")
    gap = (want_logits - got_logits).abs().max().item()
    assert gap <= LOGIT_TOLERANCE, gap


# -- gpt-oss: sinks and alternating sliding-window layers ---------------------
def gpt_oss_config():
    return transformers.GptOssConfig(
        vocab_size=512, hidden_size=64, intermediate_size=64, head_dim=16,
        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=hf_compare.PAD, bos_token_id=1, eos_token_id=None)


@pytest.fixture(scope="module")
def gpt_oss_eager():
    """The eager model (sinks drawn large enough to matter) and its greedy generation."""
    reference = hf_compare.build_model(gpt_oss_config(), "eager", torch.float32, "cpu")
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in reference.model.layers:
            sinks = layer.self_attn.sinks
            sinks.copy_(torch.randn(sinks.shape, generator=g) * 2)
    ids, mask = hf_compare.prompt_batch()
    return reference, ids, mask, hf_compare.greedy(reference, ids, mask, NEW_TOKENS)


def gpt_oss_attnserve(reference):
    return hf_compare.build_model(gpt_oss_config(), "attnserve", torch.float32, "cpu",
                                  reference.state_dict())


def test_gpt_oss_sinks_and_sliding_window_match_eager_fp32(recorded, gpt_oss_eager):
    _, calls, _ = recorded
    reference, ids, mask, want = gpt_oss_eager
    ours = gpt_oss_attnserve(reference)
    got = hf_compare.greedy(ours, ids, mask, NEW_TOKENS)
    assert_same(want.tokens, got.tokens, want.logits, got.logits)
    layers = ours.config.num_hidden_layers
    assert len(calls) == layers * NEW_TOKENS
    for i, call in enumerate(calls):
        layer = ours.model.layers[i % layers].self_attn
        assert call["sinks"] is layer.sinks
        # transformers' window (key j > query i - W, causal) as FlashAttention-2 maps it;
        # the padded batch goes unpadded (varlen), with no mask on the wire.
        assert call["window"] == ((WINDOW - 1, WINDOW - 1) if i % 2 == 0 else None)
        assert call["causal"] and "mask" not in call and "bias" not in call
    assert all(call.get("cu_seqlens_q") is not None for call in calls[:layers])  # prefill


@pytest.mark.parametrize("drop", ["sinks", "window"])
def test_gpt_oss_comparison_can_fail(recorded, gpt_oss_eager, drop):
    """Without the sinks, or without the window, the prefill logits are not eager's."""
    client, _, original = recorded
    reference, ids, mask, want = gpt_oss_eager
    client.forward = lambda *a, **kw: original(*a, **{**kw, drop: None})
    got = hf_compare.greedy(gpt_oss_attnserve(reference), ids, mask, 1)
    assert (got.logits[0] - want.logits[0]).abs().max().item() > 1e-2


@pytest.fixture
def kv_recorded(server, monkeypatch):
    """A registered client, and the keyword arguments of every append_attend call made
    through a ServerCache (`drop` in the list: that argument is left out on its way)."""
    client = attnserve.hf.register(Client(server.target, timeout=120))
    calls, drop = [], []
    original = kv.Cache.append_attend

    def recording(self, *a, **kw):
        calls.append(kw)
        return original(self, *a, **{k: v for k, v in kw.items() if k not in drop})

    monkeypatch.setattr(kv.Cache, "append_attend", recording)
    yield client, calls, drop
    client.close()


def test_gpt_oss_kv_on_server_matches_eager_fp32(kv_recorded, gpt_oss_eager):
    """K/V on the server (ServerCache): the sinks and the sliding windows go on the
    append-and-attend calls; eager's greedy tokens."""
    client, calls, _ = kv_recorded
    reference, ids, mask, want = gpt_oss_eager
    ours = gpt_oss_attnserve(reference)
    layers = ours.config.num_hidden_layers
    with ServerCache(client, ours.config, max_tokens=ids.shape[1] + NEW_TOKENS) as cache:
        got = hf_compare.greedy(ours, ids, mask, NEW_TOKENS, past_key_values=cache)
        # Each row's sequence holds its real tokens: the prompt and the tokens fed back.
        real = mask.sum(dim=1).tolist()
        assert [s.lengths for s in cache.sequences] == [[n + NEW_TOKENS - 1] * layers
                                                        for n in real]
    assert_same(want.tokens, got.tokens, want.logits, got.logits)
    assert len(calls) == layers * NEW_TOKENS
    for i, call in enumerate(calls):
        layer = ours.model.layers[i % layers].self_attn
        assert call["sinks"] is layer.sinks
        assert call["window"] == ((WINDOW - 1, WINDOW - 1) if i % 2 == 0 else None)
        assert call["causal"] and "mask" not in call and "bias" not in call


@pytest.mark.parametrize("drop", ["sinks", "window"])
def test_gpt_oss_kv_on_server_comparison_can_fail(kv_recorded, gpt_oss_eager, drop):
    """Without the sinks, or without the window, on the K/V calls: not eager's logits."""
    client, _, dropped = kv_recorded
    dropped.append(drop)
    reference, ids, mask, want = gpt_oss_eager
    ours = gpt_oss_attnserve(reference)
    with ServerCache(client, ours.config, max_tokens=ids.shape[1] + 2) as cache:
        got = hf_compare.greedy(ours, ids, mask, 1, past_key_values=cache)
    assert (got.logits[0] - want.logits[0]).abs().max().item() > 1e-2


# -- a Llama driven with custom 4-D masks ---------------------------------------
SEGMENT_A = 7      # row 0: sequences A (7 tokens) and B (9) packed; new tokens continue B
PREFIX = 10        # row 1: a prefix-LM, bidirectional over its first 10 tokens
WIDTH = 16


def allowed(q_cols: torch.Tensor, width: int) -> torch.Tensor:
    """[2, Sq, Sk] True = attend, for query columns q_cols over keys 0..width-1."""
    i, j = q_cols[:, None], torch.arange(width)[None, :]
    causal = j <= i
    same_segment = (i < SEGMENT_A) == (j < SEGMENT_A)
    prefix = (i < PREFIX) & (j < PREFIX)
    return torch.stack([causal & same_segment, causal | prefix])


def mask_4d(keep: torch.Tensor, q_cols: torch.Tensor, kind: str, heads: int) -> torch.Tensor:
    """keep [2, Sq, Sk] as a model's 4-D mask: "additive" (0 / finfo.min, eager's),
    "boolean", or "bias" (a per-head distance bias where kept)."""
    if kind == "boolean":
        return keep[:, None]
    lowest = torch.finfo(torch.float32).min
    if kind == "additive":
        return torch.where(keep, 0.0, lowest)[:, None]
    distance = (q_cols[:, None] - torch.arange(keep.shape[-1])[None, :]).abs().float()
    slopes = torch.linspace(0.05, 0.4, heads)[:, None, None]
    return torch.where(keep[:, None], -slopes * distance, lowest)  # [2, Hq, Sq, Sk]


def greedy_4d(model, ids: torch.Tensor, kind: str, steps: int, cache=None):
    """Greedy tokens and logits, every forward given the rows' 4-D masks (transformers'
    DynamicCache unless `cache`)."""
    heads = model.config.num_attention_heads
    positions = torch.stack([torch.cat([torch.arange(SEGMENT_A), torch.arange(WIDTH - SEGMENT_A)]),
                             torch.arange(WIDTH)])
    if cache is None:
        cache = transformers.DynamicCache(config=model.config)
    tokens, logits = ids, []
    q_cols, step_ids, step_pos = torch.arange(WIDTH), ids, positions
    with torch.no_grad():
        for _ in range(steps):
            width = int(q_cols[-1]) + 1
            mask = mask_4d(allowed(q_cols, width), q_cols, kind, heads)
            out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos,
                        past_key_values=cache, use_cache=True)
            last = out.logits[:, -1].float()
            logits.append(last)
            step_ids = last.argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, step_ids], dim=1)
            step_pos = step_pos[:, -1:] + 1
            q_cols = torch.tensor([width])
    return tokens, torch.stack(logits)


@pytest.fixture(scope="module")
def llama_eager():
    reference = hf_compare.build_model(hf_compare.small_llama_config(), "eager", torch.float32,
                                       "cpu")
    ids = torch.randint(2, 512, (2, WIDTH), generator=torch.Generator().manual_seed(3))
    return reference, ids, {kind: greedy_4d(reference, ids, kind, NEW_TOKENS)
                            for kind in ("additive", "bias")}


@pytest.mark.parametrize("kind", ["additive", "boolean", "bias"])
def test_custom_4d_mask_matches_eager_fp32(recorded, llama_eager, kind):
    _, calls, _ = recorded
    reference, ids, want = llama_eager
    ours = hf_compare.build_model(hf_compare.small_llama_config(), "attnserve", torch.float32,
                                  "cpu", reference.state_dict())
    # Eager adds a mask to the scores: it takes the boolean mask's additive twin.
    want_tokens, want_logits = want["bias" if kind == "bias" else "additive"]
    got_tokens, got_logits = greedy_4d(ours, ids, kind, NEW_TOKENS)
    assert_same(want_tokens, got_tokens, want_logits, got_logits)
    assert len(calls) == ours.config.num_hidden_layers * NEW_TOKENS
    prefill = calls[0]
    assert not prefill["causal"] and prefill["window"] is None  # the mask is the whole pattern
    assert prefill["mask"].dtype == torch.bool and prefill["mask"].shape == (2, 1, WIDTH, WIDTH)
    assert torch.equal(prefill["mask"][:, 0], allowed(torch.arange(WIDTH), WIDTH))
    if kind == "bias":  # finite entries go as the bias, per head
        assert prefill["bias"].shape == (2, ours.config.num_attention_heads, WIDTH, WIDTH)
    else:
        assert "bias" not in prefill
    # Decode: row 0 still excludes sequence A's keys, so a mask goes every step.
    assert all(call["mask"].shape[-2] == 1 for call in calls[ours.config.num_hidden_layers:])


def test_custom_4d_mask_changes_eager(llama_eager):
    """The custom mask matters: eager with the plain causal mask gives other logits."""
    reference, ids, want = llama_eager
    with torch.no_grad():
        causal = reference(input_ids=ids).logits[:, -1].float()
    assert (causal - want["additive"][1][0]).abs().max().item() > 1e-2


def test_packed_sequences_from_position_ids_match_eager(recorded, llama_eager):
    """position_ids restarting mid-row (no mask): transformers' packed-sequence mask,
    which attnserve_mask materializes and eager applies."""
    _, calls, _ = recorded
    reference, ids, _ = llama_eager
    ours = hf_compare.build_model(hf_compare.small_llama_config(), "attnserve", torch.float32,
                                  "cpu", reference.state_dict())
    positions = torch.cat([torch.arange(SEGMENT_A), torch.arange(WIDTH - SEGMENT_A)])[None]
    with torch.no_grad():
        want = reference(input_ids=ids[:1], position_ids=positions, use_cache=False).logits
        got = ours(input_ids=ids[:1], position_ids=positions, use_cache=False).logits
    assert torch.equal(want.argmax(-1), got.argmax(-1))
    assert (want - got).abs().max().item() <= LOGIT_TOLERANCE
    assert torch.equal(calls[0]["mask"][0, 0], allowed(torch.arange(WIDTH), WIDTH)[0])


@pytest.mark.parametrize("kind", ["additive", "boolean", "bias"])
def test_custom_4d_mask_kv_on_server_matches_eager_fp32(kv_recorded, llama_eager, kind):
    """K/V on the server (ServerCache): the 4-D mask (and the bias) go on every
    append-and-attend call over each row's whole history; eager's greedy tokens."""
    client, calls, _ = kv_recorded
    reference, ids, want = llama_eager
    ours = hf_compare.build_model(hf_compare.small_llama_config(), "attnserve", torch.float32,
                                  "cpu", reference.state_dict())
    layers, heads = ours.config.num_hidden_layers, ours.config.num_attention_heads
    want_tokens, want_logits = want["bias" if kind == "bias" else "additive"]
    with ServerCache(client, ours.config, max_tokens=WIDTH + NEW_TOKENS) as cache:
        got_tokens, got_logits = greedy_4d(ours, ids, kind, NEW_TOKENS, cache=cache)
        assert [s.lengths for s in cache.sequences] == [[WIDTH + NEW_TOKENS - 1] * layers] * 2
    assert_same(want_tokens, got_tokens, want_logits, got_logits)
    assert len(calls) == layers * NEW_TOKENS
    prefill = calls[0]
    assert not prefill["causal"] and prefill["window"] is None  # the mask is the whole pattern
    assert prefill["mask"].shape == (2, 1, WIDTH, WIDTH)
    assert torch.equal(prefill["mask"][:, 0], allowed(torch.arange(WIDTH), WIDTH))
    assert ("bias" in prefill) == (kind == "bias")
    if kind == "bias":
        assert prefill["bias"].shape == (2, heads, WIDTH, WIDTH)
    # Decode: one query over the whole history; row 0 still excludes sequence A.
    last = calls[-1]["mask"]
    assert last.shape == (2, 1, 1, WIDTH + NEW_TOKENS - 1)
    assert not last[0, 0, 0, :SEGMENT_A].any() and last[0, 0, 0, SEGMENT_A:].all()


def test_custom_4d_mask_kv_on_server_comparison_can_fail(kv_recorded, llama_eager):
    """Without the mask on the K/V calls: not eager's logits."""
    client, _, dropped = kv_recorded
    dropped.append("mask")
    reference, ids, want = llama_eager
    ours = hf_compare.build_model(hf_compare.small_llama_config(), "attnserve", torch.float32,
                                  "cpu", reference.state_dict())
    with ServerCache(client, ours.config, max_tokens=WIDTH + 2) as cache:
        _, got_logits = greedy_4d(ours, ids, "additive", 1, cache=cache)
    assert (got_logits[0] - want["additive"][1][0]).abs().max().item() > 1e-2


def test_additive_mask_rule():
    """-inf and entries <= finfo.min / 2 remove keys; other nonzero entries are a bias."""
    lowest = torch.finfo(torch.float32).min
    m = torch.tensor([[[[0.0, -float("inf"), lowest, lowest / 2, -1e9, 0.5]]]])
    out = attnserve.hf.additive_mask(m)
    assert out["mask"].tolist() == [[[[True, False, False, False, True, True]]]]
    assert out["bias"].tolist() == [[[[0.0, 0.0, 0.0, 0.0, -1e9, 0.5]]]]
    assert attnserve.hf.additive_mask(torch.zeros(1, 1, 2, 2)) == {}
    assert set(attnserve.hf.additive_mask(torch.tensor([[[[0.0, lowest]]]]))) == {"mask"}
    with pytest.raises(ValueError, match="boolean .* or additive float"):
        attnserve.hf.additive_mask(torch.ones(1, 1, 2, 2, dtype=torch.long))
