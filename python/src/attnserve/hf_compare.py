"""Greedy generation through attnserve against transformers' own attention: where tokens first differ.

    python -m attnserve.hf_compare --target 127.0.0.1:50051 --dtype float32 --expect-identical
    python -m attnserve.hf_compare --target 127.0.0.1:50051 --dtype bfloat16 --device cuda

A small Llama built from a config with a fixed seed (4 layers, hidden 256, 8
query heads, 2 KV heads, RoPE; random weights: nothing is downloaded), a
left-padded batch of prompts of mixed lengths, N greedy tokens per row, with
attn_implementation="attnserve" in both modes (stateless, and K/V on the
server through attnserve.hf_cache.ServerCache) and with transformers' "sdpa"
on the same device (TF32 off), the same weights.

For each row it reports the first generated step whose token differs and the
logit margin there: how far apart the two candidate tokens were in sdpa's
logits and in attnserve's. In FP32 the tokens should be identical. In BF16 a
near-tie can flip legitimately (rounding differs between any two kernels), so
the same is reported for transformers' "eager" attention against "sdpa": the
legitimate BF16 noise to compare with. The logit gap over the steps where a
row's inputs are still the same (up to its first difference) says how close
the two implementations are.

python/tests/test_hf.py uses these functions; scripts/device/gpu-python.sh runs this
command against the CUDA server.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import transformers

PAD = 0
PROMPT_LENGTHS = (5, 17, 11, 1)
NEW_TOKENS = 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def small_llama_config(**overrides: Any) -> "transformers.LlamaConfig":
    """The issue's small Llama: 4 layers, hidden 256, 8 query heads, 2 KV heads, RoPE."""
    fields = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                  rope_theta=10000.0, pad_token_id=PAD, bos_token_id=1, eos_token_id=None,
                  tie_word_embeddings=False)
    fields.update(overrides)
    return transformers.LlamaConfig(**fields)


def prompt_batch(lengths: Sequence[int] = PROMPT_LENGTHS, vocab_size: int = 512,
                 seed: int = 1234) -> Tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts (token ids 2..vocab-1) and their attention mask, on the CPU."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(2, vocab_size, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask


def build_model(config: Any, implementation: str, dtype: torch.dtype, device: str,
                weights: Optional[Dict[str, torch.Tensor]] = None) -> torch.nn.Module:
    """AutoModelForCausalLM.from_config with `implementation`; seed 0's weights, or `weights`."""
    config = config.__class__.from_dict(config.to_dict())  # from_config records the impl in it
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=implementation, dtype=dtype).eval()
    if weights is not None:
        model.load_state_dict(weights)
    assert model.config._attn_implementation == implementation
    return model


def no_tf32() -> None:
    """FP32 matrix products in full FP32 on the GPU (TF32 off), as the comparison needs."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@dataclasses.dataclass
class Generation:
    tokens: torch.Tensor   # [B, prompt width + new], on the CPU
    logits: torch.Tensor   # [new, B, vocab] FP32, on the CPU: each step's raw logits


def greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
           new_tokens: int = NEW_TOKENS, **kwargs: Any) -> Generation:
    """`new_tokens` greedy tokens per row (no early stop), with each step's logits."""
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=PAD, return_dict_in_generate=True,
                             output_logits=True, **kwargs)
    logits = torch.stack([x.float().cpu() for x in out.logits])
    return Generation(tokens=out.sequences.cpu(), logits=logits)


@dataclasses.dataclass
class RowDiff:
    """One row of a comparison of `got` against `want` (the reference)."""
    row: int
    first_diff: Optional[int]   # generated step (0 = the first new token), None if identical
    want_token: Optional[int] = None
    got_token: Optional[int] = None
    want_margin: Optional[float] = None  # want's logit[want_token] - logit[got_token] there
    got_margin: Optional[float] = None   # got's logit[got_token] - logit[want_token] there
    max_logit_gap: float = 0.0  # max |got - want| logit over the steps with equal inputs

    def line(self) -> str:
        if self.first_diff is None:
            return f"row {self.row}: identical, max |logit gap| {self.max_logit_gap:.3g}"
        return (f"row {self.row}: first differs at step {self.first_diff} "
                f"(token {self.want_token} vs {self.got_token}); margin there "
                f"{self.want_margin:.3g} in the reference's logits, {self.got_margin:.3g} in "
                f"these; max |logit gap| up to there {self.max_logit_gap:.3g}")


def compare(want: Generation, got: Generation) -> List[RowDiff]:
    """Per row: the first generated step whose token differs, and the margins there."""
    new = want.logits.shape[0]
    width = want.tokens.shape[1] - new
    rows = []
    for b in range(want.tokens.shape[0]):
        w, g = want.tokens[b, width:], got.tokens[b, width:]
        differ = (w != g).nonzero().flatten()
        first = int(differ[0]) if len(differ) else None
        last = new - 1 if first is None else first  # inputs equal up to and including it
        gap = float((got.logits[:last + 1, b] - want.logits[:last + 1, b]).abs().max())
        diff = RowDiff(row=b, first_diff=first, max_logit_gap=gap)
        if first is not None:
            a, c = int(w[first]), int(g[first])
            diff.want_token, diff.got_token = a, c
            diff.want_margin = float(want.logits[first, b, a] - want.logits[first, b, c])
            diff.got_margin = float(got.logits[first, b, c] - got.logits[first, b, a])
        rows.append(diff)
    return rows


def first_step(diffs: List[RowDiff]) -> Optional[int]:
    steps = [d.first_diff for d in diffs if d.first_diff is not None]
    return min(steps) if steps else None


@dataclasses.dataclass
class Comparison:
    name: str                  # "attnserve stateless vs sdpa", ...
    rows: List[RowDiff]

    @property
    def identical(self) -> bool:
        return first_step(self.rows) is None

    def lines(self) -> List[str]:
        first = first_step(self.rows)
        head = (f"{self.name}: identical tokens" if first is None else
                f"{self.name}: tokens first differ at step {first}")
        return [head] + ["  " + d.line() for d in self.rows]


def run_comparison(target: Any, dtype: str = "bfloat16", device: str = "cpu",
                   modes: Sequence[str] = ("stateless", "kv"), new_tokens: int = NEW_TOKENS,
                   with_eager: bool = True,
                   sdpa: Optional[Tuple[torch.nn.Module, Generation]] = None
                   ) -> Tuple[List[Comparison], Tuple[torch.nn.Module, Generation]]:
    """Generates with "sdpa" (unless given), each attnserve mode and "eager" on
    `device`, and compares each with sdpa. target: a "host:port" or an attnserve.Client.
    Returns the comparisons and (the sdpa model, its generation) for reuse."""
    import attnserve.hf
    from attnserve.client import Client
    from attnserve.hf_cache import ServerCache

    no_tf32()
    torch_dtype = DTYPES[dtype]
    config = small_llama_config()
    ids, mask = prompt_batch()
    if sdpa is None:
        reference = build_model(config, "sdpa", torch_dtype, device)
        sdpa = (reference, greedy(reference, ids, mask, new_tokens))
    reference, want = sdpa
    weights = reference.state_dict()
    owned = not isinstance(target, Client)
    client = attnserve.hf.register(target)
    results = []
    try:
        ours = build_model(config, "attnserve", torch_dtype, device, weights)
        for mode in modes:
            if mode == "stateless":
                got = greedy(ours, ids, mask, new_tokens)
            elif mode == "kv":
                with ServerCache(client, ours.config, max_tokens=ids.shape[1] + new_tokens) as c:
                    got = greedy(ours, ids, mask, new_tokens, past_key_values=c)
            else:
                raise ValueError(f"modes: expected stateless or kv, got {mode!r}")
            results.append(Comparison(f"attnserve {mode} vs sdpa ({dtype}, {device})",
                                      compare(want, got)))
    finally:
        if owned:
            client.close()
    if with_eager:
        eager = build_model(config, "eager", torch_dtype, device, weights)
        results.append(Comparison(f"eager vs sdpa ({dtype}, {device}; transformers' own "
                                  "kernels: the legitimate difference)",
                                  compare(want, greedy(eager, ids, mask, new_tokens))))
    return results, sdpa


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attnserve.hf_compare",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="127.0.0.1:50051", help="host:port of the server")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:N")
    ap.add_argument("--modes", default="stateless,kv", help="stateless, kv or both")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch CPU threads (0 = torch's default; 1 on a loaded machine)")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager-vs-sdpa baseline")
    ap.add_argument("--expect-identical", action="store_true",
                    help="exit 1 unless every attnserve mode gives sdpa's tokens")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    results, _ = run_comparison(a.target, a.dtype, a.device, a.modes.split(","), a.new_tokens,
                                with_eager=not a.no_eager)
    for comparison in results:
        print("\n".join(comparison.lines()), flush=True)
    ours = [c for c in results if c.name.startswith("attnserve")]
    if a.expect_identical and not all(c.identical for c in ours):
        print("FAIL: attnserve's tokens differ from sdpa's", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
