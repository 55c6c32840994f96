"""transformers with attn_implementation="attnserve" generates the same tokens as "sdpa" (FP32, CPU).

A small Llama built from a config with a fixed seed (4 layers, hidden 256, 8
query heads, 2 KV heads, RoPE), a left-padded batch of prompts of mixed
lengths, 64 greedy tokens each, every attention call through the server.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attnserve.hf  # noqa: E402
from attnserve import Client  # noqa: E402

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


def generate(model, ids, mask):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD)


def test_greedy_tokens_match_sdpa_fp32(server):
    torch.set_num_threads(2)
    torch.manual_seed(0)
    cfg = small_llama_config()
    # Each model gets its own config: from_config records the implementation in it.
    reference = transformers.AutoModelForCausalLM.from_config(
        small_llama_config(), attn_implementation="sdpa", dtype=torch.float32).eval()
    assert reference.config._attn_implementation == "sdpa"
    client = attnserve.hf.register(Client(server.target, timeout=120))
    try:
        ours = transformers.AutoModelForCausalLM.from_config(
            cfg, attn_implementation="attnserve", dtype=torch.float32).eval()
        ours.load_state_dict(reference.state_dict())
        assert ours.config._attn_implementation == "attnserve"

        calls = []
        original = client.forward
        client.forward = lambda *a, **kw: calls.append(kw.get("cu_seqlens_q")) or original(*a, **kw)

        ids, mask = prompt_batch()
        want = generate(reference, ids, mask)
        assert not calls  # the reference never reached the server
        got = generate(ours, ids, mask)
    finally:
        client.close()
    assert want.shape == (len(PROMPT_LENGTHS), max(PROMPT_LENGTHS) + NEW_TOKENS)
    # Every attention call went to the server (4 layers x (prefill + 63 decode steps)),
    # as packed varlen: the batch is padded.
    assert len(calls) == cfg.num_hidden_layers * NEW_TOKENS
    assert all(cu is not None for cu in calls)
    assert calls[0].tolist() == [0, 5, 22, 33, 34]
    first_diff = next((i for i in range(want.shape[1]) if not torch.equal(want[:, i], got[:, i])),
                      None)
    assert first_diff is None, (f"tokens differ from position {first_diff}:\n"
                                f"sdpa      {want.tolist()}\nattnserve {got.tolist()}")
