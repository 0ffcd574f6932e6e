"""A prompt's first tokens by the one rule of every place that prefills: the request's
earlier output counts in its penalties, a spent thinking budget forces the think-end token,
and the choices draw apart, each reproducibly."""

from __future__ import annotations

import torch

from common.sampling.first_token import sample_first
from common.sampling.params import SamplingParams


def test_earlier_output_thinking_and_choices() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, 1.0, 0.0])
    greedy = SamplingParams(max_tokens=4, temperature=0.0, frequency_penalty=1.0)
    # Token 1 was generated before (the prompt's last id is the request's own output).
    [first] = sample_first(logits, greedy, [4, 4, 1], 1, None, 1, ())
    assert first.token_id == 2
    [first] = sample_first(logits, greedy, [4, 4, 1], 0, None, 1, ())
    assert first.token_id == 1  # the same id in the prompt is not penalized
    spent = SamplingParams(max_tokens=4, temperature=0.0, think_end_ids=(3,), thinking_budget=1)
    [first] = sample_first(logits, spent, [4, 2], 1, None, 1, ())
    assert first.token_id == 3
    sampled = SamplingParams(max_tokens=4, temperature=1.0, seed=5)
    firsts = sample_first(logits, sampled, [4, 2], 0, None, 8, ())
    assert len({t.token_id for t in firsts}) > 1
    assert firsts == sample_first(logits, sampled, [4, 2], 0, None, 8, ())
