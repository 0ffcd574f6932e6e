"""The serving benchmarks' prompts: windows of real Python source, and for the `edit` mix,
text whose answer repeats what the prompt holds.

`edit` stands for the requests prompt-lookup decoding is made for (a code edit, a rename:
the answer copies most of the code given). The demo model cannot follow an edit instruction,
and given a window of source twice it does not copy it a third time (its greedy answers to
such prompts matched the window at no position). What it does repeat is its own writing: so
an edit prompt is a window of source followed by the model's own greedy continuation of it,
and the answer goes on with that text, repeating its phrases as the model's answers do.
Every configuration serves the same prompts, so this changes which tokens are decoded, not
how any stack is compared.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json.decoder
from dataclasses import dataclass

# A prime stride between windows, so windows overlap at different offsets and nothing
# caches a prefix across requests.
WINDOW_STRIDE = 97


@dataclass(frozen=True)
class Mix:
    name: str
    prompt_tokens: int
    max_tokens: int


def make_prompts(model: str, mix: Mix, count: int) -> list[list[int]]:
    """`count` distinct prompts of `mix.prompt_tokens` tokens for `mix`."""
    if mix.name != "edit":
        return source_windows(model, mix.prompt_tokens, count)
    from common.loading.serving_model import load_prefill_model
    from common.model.generate import generate
    from common.sampling.params import SamplingParams

    half = mix.prompt_tokens // 2
    exact = load_prefill_model(model, "")  # exact MLA in fp32: the continuation is the model's
    params = SamplingParams(max_tokens=mix.prompt_tokens - half, temperature=0.0, ignore_eos=True)
    return [w + generate(exact, w, params).token_ids for w in source_windows(model, half, count)]


def source_windows(model: str, tokens: int, count: int) -> list[list[int]]:
    """`count` distinct windows of `tokens` tokens of Python source text."""
    from common.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model)
    ids: list[int] = []
    for module in (argparse, json.decoder, dataclasses, inspect):
        ids += tok.encode(inspect.getsource(module), add_bos=False)
        if len(ids) >= tokens + WINDOW_STRIDE * count:
            break
    span = len(ids) - tokens
    if span < 1:
        raise ValueError(f"not enough text for {tokens}-token prompts")
    starts = [(WINDOW_STRIDE * i) % span for i in range(count)]
    return [ids[s : s + tokens] for s in starts]
