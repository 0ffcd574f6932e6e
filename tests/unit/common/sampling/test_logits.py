"""Logits processing (common/sampling/logits.py): the batch at once == each row alone == a naive
per-token Python implementation; the decode leader's TokenHistory == counts from lists."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from common.sampling.keyed import DrawKey
from common.sampling.logits import (
    LogitsContext,
    TokenHistory,
    context_for,
    process_logits,
    token_rows,
)
from common.sampling.params import SamplingError, SamplingParams
from common.sampling.sampler import sample_batch

V = 48
EOS = (1,)


def _naive(
    row: list[float],
    p: SamplingParams,
    prompt: list[int],
    output: list[int],
    allowed: set[int] | None,
) -> list[float]:
    out = list(row)
    if p.min_tokens and len(output) < p.min_tokens:
        for t in p.stop_ids(EOS):
            out[t] = -math.inf
    for t, v in p.logit_bias:
        out[t] += v
    if allowed is not None:
        out = [x if t in allowed else -math.inf for t, x in enumerate(out)]
    counts = Counter(output)
    for t in range(V):
        if counts[t] or t in prompt:
            r = p.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        out[t] -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
    return out


PARAMS = [
    SamplingParams(),  # nothing to process
    SamplingParams(presence_penalty=1.5, frequency_penalty=0.5),
    SamplingParams(repetition_penalty=1.7, stop_token_ids=(7,)),
    SamplingParams(logit_bias=((3, 5.0), (9, -100.0)), min_tokens=4, stop_token_ids=(7,)),
    SamplingParams(frequency_penalty=-1.0, repetition_penalty=0.6, logit_bias=((5, 2.0),)),
    SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=(11, 12)),
]


def _case(seed: int) -> tuple[torch.Tensor, list[list[int]], list[list[int]], torch.Tensor]:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    logits = torch.randn(len(PARAMS), V) * 3
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(1, 9))] for _ in PARAMS]
    outputs = [[rng.randrange(V) for _ in range(rng.randrange(0, 7))] for _ in PARAMS]
    allowed = torch.rand(len(PARAMS), V) > 0.3
    allowed[0] = True  # a row without a grammar
    return logits, prompts, outputs, allowed


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("with_grammar", [False, True])
def test_batch_equals_rows_equals_naive(seed: int, with_grammar: bool) -> None:
    logits, prompts, outputs, allowed = _case(seed)
    mask = allowed if with_grammar else None
    ctx = context_for(PARAMS, prompts, outputs, EOS, V, "cpu", mask)
    assert ctx is not None
    batch = process_logits(logits, PARAMS, ctx)
    for b, p in enumerate(PARAMS):
        row_ctx = context_for(
            [p],
            [prompts[b]],
            [outputs[b]],
            EOS,
            V,
            "cpu",
            None if mask is None else mask[b : b + 1],
        )
        alone = (
            logits[b : b + 1]
            if row_ctx is None
            else process_logits(logits[b : b + 1], [p], row_ctx)
        )
        naive_allowed = set(allowed[b].nonzero().flatten().tolist()) if with_grammar else None
        naive = _naive(logits[b].tolist(), p, prompts[b], outputs[b], naive_allowed)
        torch.testing.assert_close(batch[b], alone[0])
        torch.testing.assert_close(batch[b], torch.tensor(naive), rtol=1e-5, atol=1e-5)


def test_token_history_matches_token_lists() -> None:
    """The leader's incremental counts (track, then one scatter per step, rows reused after
    release, the table grown) equal counts built from the whole lists."""
    rng = random.Random(5)
    history = TokenHistory(V, "cpu", rows=2)
    seqs = {}
    for i in range(5):  # more than the initial rows: the table grows
        prompt = [rng.randrange(V) for _ in range(4)]
        prior = [rng.randrange(V) for _ in range(i)]
        seqs[i] = (history.track(prompt, prior), prompt, list(prior))
    history.release(seqs.pop(2)[0])
    seqs[9] = (history.track([3, 3], [4]), [3, 3], [4])
    for _ in range(6):
        keys = list(seqs)
        tokens = [rng.randrange(V) for _ in keys]
        rows = torch.tensor([seqs[k][0] for k in keys])
        history.record(rows, torch.tensor(tokens))
        for k, t in zip(keys, tokens, strict=True):
            seqs[k][2].append(t)
    keys = list(seqs)
    counts, prompt_mask = history.gather(torch.tensor([0] + [seqs[k][0] for k in keys]))
    expected = token_rows([[]] + [seqs[k][2] for k in keys], V, "cpu")
    torch.testing.assert_close(counts, expected)
    assert torch.equal(prompt_mask[1:], token_rows([seqs[k][1] for k in keys], V, "cpu") > 0)
    assert not prompt_mask[0].any()


def test_token_history_fork_copies_a_row_that_then_goes_its_own_way() -> None:
    history = TokenHistory(V, "cpu", rows=2)
    parent = history.track([3, 4], [5, 5])
    fork = history.fork(parent)  # the table grows: 2 rows hold only row 0 and one sequence
    assert fork not in (0, parent) and history.fork(0) == 0
    history.record(torch.tensor([parent, fork]), torch.tensor([6, 7]))
    counts, prompt = history.gather(torch.tensor([parent, fork]))
    assert counts[:, 5].tolist() == [2, 2] and prompt[:, 3].tolist() == [True, True]
    assert counts[:, 6].tolist() == [1, 0] and counts[:, 7].tolist() == [0, 1]


def test_huge_logit_bias_forces_its_token_greedy_and_sampled() -> None:
    logits = torch.randn(3, V)
    params = [
        SamplingParams(temperature=0.0, logit_bias=((17, 100.0),)),
        SamplingParams(temperature=1.0, seed=3, logit_bias=((17, 100.0),)),
        SamplingParams(temperature=0.0),
    ]
    ctx = context_for(params, [[2]] * 3, [[]] * 3, EOS, V, "cpu")
    keys = [DrawKey(3, 0, b) for b in range(3)]
    tokens = sample_batch(logits, params, keys, ctx)
    assert [t.token_id for t in tokens[:2]] == [17, 17]
    assert tokens[2].token_id == int(logits[2].argmax())
    # Logprobs stay the model's own (raw logits), as in vLLM.
    assert tokens[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[17]))


def test_min_tokens_forbids_stop_until_reached_and_seeded_sampling_reproduces() -> None:
    logits = torch.zeros(1, V)
    logits[0, 1] = 50.0  # EOS would always win
    p = SamplingParams(temperature=0.0, min_tokens=2)
    early = context_for([p], [[5]], [[4]], EOS, V, "cpu")
    late = context_for([p], [[5]], [[4, 4]], EOS, V, "cpu")
    assert sample_batch(logits, [p], [DrawKey(0, 0, 1)], early)[0].token_id != 1
    assert sample_batch(logits, [p], [DrawKey(0, 0, 2)], late)[0].token_id == 1
    q = SamplingParams(temperature=0.9, seed=11, presence_penalty=1.0, min_p=0.05, top_k=20)
    ctx = context_for([q], [[1, 2]], [[3, 3, 4]], EOS, V, "cpu")
    row = torch.randn(1, V)
    a = sample_batch(row, [q], [DrawKey(11, 0, 5)], ctx)[0].token_id
    b = sample_batch(row, [q], [DrawKey(11, 0, 5)], ctx)[0].token_id
    assert a == b


def test_min_p_keeps_tokens_near_the_top() -> None:
    from common.sampling.sampler import filtered_logits_batch

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filtered_logits_batch(logits, [SamplingParams(min_p=0.25)]))
    assert kept.tolist() == [[True, True, True, False]]


def test_context_is_none_without_processing_and_grammar_fallback() -> None:
    assert context_for([SamplingParams()], [[1]], [[]], EOS, V, "cpu") is None
    # A grammar that only allows EOS while min_tokens forbids it: EOS wins over no token.
    allowed = torch.zeros(1, V, dtype=torch.bool)
    allowed[0, 1] = True
    p = SamplingParams(temperature=0.0, min_tokens=5)
    ctx = LogitsContext([0], EOS, allowed=allowed)
    assert sample_batch(torch.randn(1, V), [p], [DrawKey(0, 0, 1)], ctx)[0].token_id == 1


@pytest.mark.parametrize(
    "kw",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3.0},
        {"repetition_penalty": 0.0},
        {"logit_bias": ((1, 101.0),)},
        {"min_tokens": 17},
        {"min_p": 1.5},
    ],
)
def test_out_of_range_controls_are_refused(kw: dict) -> None:
    with pytest.raises(SamplingError, match=next(iter(kw))):
        SamplingParams(max_tokens=16, **kw)
