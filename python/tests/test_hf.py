"""transformers with attn_implementation="attnserve" generates the same tokens as "sdpa" (FP32, CPU).

A small Llama built from a config with a fixed seed (4 layers, hidden 256, 8
query heads, 2 KV heads, RoPE), a left-padded batch of prompts of mixed
lengths, 64 greedy tokens each, every attention call through the server: in
both modes, stateless (whole K/V each call) and K/V on the server
(attnserve.hf_cache.ServerCache). The sdpa reference runs once for both.
In BF16 tokens may flip at near-ties: test_bf16_first_differing_token reports
where, with the logit margin there, beside transformers' own eager-vs-sdpa
difference (attnserve.hf_compare, which scripts/device/gpu-python.sh runs on the GPU).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attnserve.hf  # noqa: E402
from attnserve import AttnServeError, Client  # noqa: E402
from attnserve import hf_compare  # noqa: E402
from attnserve.hf_cache import ServerCache  # noqa: E402
from attnserve.kv import Cache  # noqa: E402

NEW_TOKENS = hf_compare.NEW_TOKENS
PROMPT_LENGTHS = hf_compare.PROMPT_LENGTHS
# Where the model runs: the CPU here; scripts/device/gpu-python.sh sets "cuda" (with
# the CUDA server as ATTNSERVE_TARGET), the same device as the server's.
DEVICE = os.environ.get("ATTNSERVE_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # On a loaded 2-core machine, torch's OpenMP threads spin against the other
    # processes: one thread generated 10 to 25 times faster than two.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def generate(model, ids, mask, **kwargs):
    return hf_compare.greedy(model, ids, mask, NEW_TOKENS, **kwargs).tokens


@pytest.fixture(scope="module")
def sdpa_run():
    """transformers' own "sdpa" model and its greedy tokens: built and run once for both modes."""
    hf_compare.no_tf32()
    reference = hf_compare.build_model(hf_compare.small_llama_config(), "sdpa", torch.float32,
                                       DEVICE)
    ids, mask = hf_compare.prompt_batch()
    want = generate(reference, ids, mask)
    assert want.shape == (len(PROMPT_LENGTHS), max(PROMPT_LENGTHS) + NEW_TOKENS)
    return reference, ids, mask, want


def attnserve_model(reference):
    """The same weights with attn_implementation="attnserve"."""
    return hf_compare.build_model(hf_compare.small_llama_config(), "attnserve", torch.float32,
                                  DEVICE, reference.state_dict())


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
                reference(input_ids=ids[:, -4:].to(DEVICE), past_key_values=cache, use_cache=True)
            assert cache.cache.stats().tokens == 0  # nothing reached the server


def test_bf16_first_differing_token(server, capsys):
    """BF16, both modes: where tokens first differ from sdpa's, and the logit margin there.

    Printed for the log (ctest --output-on-failure -V shows it). What must hold:
    while a row's inputs are the same, attnserve's logits stay within twice the
    gap between transformers' own eager and sdpa kernels (the legitimate BF16
    difference), and a token flips only where sdpa's margin between the two
    candidates is within that gap (a near-tie)."""
    with Client(server.target, timeout=120) as client:
        results, _ = hf_compare.run_comparison(client, "bfloat16", DEVICE, ("stateless", "kv"))
    with capsys.disabled():
        print()
        for comparison in results:
            print("\n".join(comparison.lines()))
    *ours, eager = results
    noise = max(d.max_logit_gap for d in eager.rows)
    assert noise > 0  # BF16 eager and sdpa do round differently
    for comparison in ours:
        for d in comparison.rows:
            assert d.max_logit_gap <= 2 * noise, (comparison.name, d.line(), noise)
            if d.first_diff is not None:
                assert abs(d.want_margin) <= noise, (comparison.name, d.line(), noise)
