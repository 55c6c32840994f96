"""transformers with attn_implementation="attnserve" generates the same tokens as "sdpa" (FP32, CPU).

A small Llama built from a config with a fixed seed (4 layers, hidden 256, 8
query heads, 2 KV heads, RoPE), a left-padded batch of prompts of mixed
lengths, 64 greedy tokens each, every attention call through the server: in
both modes, stateless (whole K/V each call) and K/V on the server
(attnserve.hf_cache.ServerCache). The sdpa reference runs once for both.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attnserve.hf  # noqa: E402
from attnserve import AttnServeError, Client  # noqa: E402
from attnserve.hf_cache import ServerCache  # noqa: E402
from attnserve.kv import Cache  # noqa: E402

NEW_TOKENS = 64
PROMPT_LENGTHS = [5, 17, 11, 1]
PAD = 0


def small_llama_config():
    return transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, pad_token_id=PAD, bos_token_id=1, eos_token_id=None,
        tie_word_embeddings=False)


def prompt_batch():
    """Left-padded prompts (token ids 2..511) and their attention mask."""
    g = torch.Generator().manual_seed(1234)
    width = max(PROMPT_LENGTHS)
    ids = torch.full((len(PROMPT_LENGTHS), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(PROMPT_LENGTHS):
        ids[row, width - n:] = torch.randint(2, 512, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask


def generate(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD,
                              **kwargs)


@pytest.fixture(scope="module")
def sdpa_run():
    """transformers' own "sdpa" model and its greedy tokens: built and run once for both modes."""
    torch.set_num_threads(2)
    torch.manual_seed(0)
    # Each model gets its own config: from_config records the implementation in it.
    reference = transformers.AutoModelForCausalLM.from_config(
        small_llama_config(), attn_implementation="sdpa", dtype=torch.float32).eval()
    assert reference.config._attn_implementation == "sdpa"
    ids, mask = prompt_batch()
    want = generate(reference, ids, mask)
    assert want.shape == (len(PROMPT_LENGTHS), max(PROMPT_LENGTHS) + NEW_TOKENS)
    return reference, ids, mask, want


def attnserve_model(reference):
    """The same weights with attn_implementation="attnserve"."""
    ours = transformers.AutoModelForCausalLM.from_config(
        small_llama_config(), attn_implementation="attnserve", dtype=torch.float32).eval()
    ours.load_state_dict(reference.state_dict())
    assert ours.config._attn_implementation == "attnserve"
    return ours


def assert_same_tokens(want, got):
    first_diff = next((i for i in range(want.shape[1]) if not torch.equal(want[:, i], got[:, i])),
                      None)
    assert first_diff is None, (f"tokens differ from position {first_diff}:\n"
                                f"sdpa      {want.tolist()}\nattnserve {got.tolist()}")


def test_greedy_tokens_match_sdpa_fp32(server, sdpa_run):
    reference, ids, mask, want = sdpa_run
    client = attnserve.hf.register(Client(server.target, timeout=120))
    try:
        ours = attnserve_model(reference)
        calls = []
        original = client.forward
        client.forward = lambda *a, **kw: calls.append(kw.get("cu_seqlens_q")) or original(*a, **kw)
        got = generate(ours, ids, mask)
    finally:
        client.close()
    # Every attention call went to the server (4 layers x (prefill + 63 decode steps)),
    # as packed varlen: the batch is padded.
    assert len(calls) == ours.config.num_hidden_layers * NEW_TOKENS
    assert all(cu is not None for cu in calls)
    assert calls[0].tolist() == [0, 5, 22, 33, 34]
    assert_same_tokens(want, got)


def test_greedy_tokens_match_sdpa_fp32_kv_on_server(server, sdpa_run, monkeypatch):
    """The same with K/V in an attnserve cache: each step sends only the new tokens."""
    reference, ids, mask, want = sdpa_run
    client = attnserve.hf.register(Client(server.target, timeout=120))
    rows = []  # query rows of each append-and-attend call
    original = Cache.append_attend_result

    def counting(self, layer, sequences, q, *args, **kwargs):
        rows.append((layer, q.shape[0]))
        return original(self, layer, sequences, q, *args, **kwargs)

    monkeypatch.setattr(Cache, "append_attend_result", counting)
    client.forward = None  # the stateless path must not run
    try:
        ours = attnserve_model(reference)
        layers = ours.config.num_hidden_layers
        with ServerCache(client, ours.config, max_tokens=max(PROMPT_LENGTHS) + NEW_TOKENS) as cache:
            got = generate(ours, ids, mask, past_key_values=cache)
            stats = cache.cache.stats()
            # Each row's sequence holds its real tokens only: prompt + 63 fed back.
            assert stats.sequences == len(PROMPT_LENGTHS)
            assert stats.tokens == layers * sum(n + NEW_TOKENS - 1 for n in PROMPT_LENGTHS)
            assert [s.lengths for s in cache.sequences] == [
                [n + NEW_TOKENS - 1] * layers for n in PROMPT_LENGTHS]
        with pytest.raises(AttnServeError):  # closing dropped the server's cache
            cache.cache.stats()
    finally:
        client.close()
    # Prefill sends the 34 real prompt tokens (no padding), each decode step 4.
    assert rows[:layers] == [(layer, sum(PROMPT_LENGTHS)) for layer in range(layers)]
    assert len(rows) == layers * NEW_TOKENS
    assert all(n == len(PROMPT_LENGTHS) for _, n in rows[layers:])
    assert_same_tokens(want, got)


def test_server_cache_refuses_another_attention(server, sdpa_run):
    """With "sdpa", a ServerCache would attend over the new tokens only: refused."""
    reference, ids, mask, _ = sdpa_run
    with Client(server.target, timeout=120) as client:
        with ServerCache(client, reference.config, max_tokens=64) as cache:
            with pytest.raises(RuntimeError, match="attn_implementation"), torch.no_grad():
                reference(input_ids=ids[:, -4:], past_key_values=cache, use_cache=True)
            assert cache.cache.stats().tokens == 0  # nothing reached the server
