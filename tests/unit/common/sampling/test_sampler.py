"""Sampling math: greedy, filters, seeds, logprobs, parameter validation."""

from __future__ import annotations

import pytest
import torch

from common.sampling.keyed import DrawKey
from common.sampling.params import SamplingError, SamplingParams
from common.sampling.sampler import filtered_logits, sample, sample_batch

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_greedy_takes_argmax_and_reports_logprob() -> None:
    tok = sample(LOGITS, SamplingParams(temperature=0.0, logprobs=2), DrawKey(0, 0, 0))
    assert tok.token_id == 0
    assert tok.logprob == pytest.approx(torch.log_softmax(LOGITS, -1)[0].item())
    assert [t for t, _ in tok.top_logprobs] == [0, 1]


def test_top_k_and_top_p_keep_the_right_support() -> None:
    kept_k = torch.isfinite(filtered_logits(LOGITS, SamplingParams(top_k=2))).nonzero().flatten()
    assert kept_k.tolist() == [0, 1]
    probs = LOGITS.softmax(-1)  # ~[0.57, 0.21, 0.13, 0.08, ...]
    kept_p = torch.isfinite(filtered_logits(LOGITS, SamplingParams(top_p=0.7))).nonzero().flatten()
    assert kept_p.tolist() == [0, 1]  # 0.57 < 0.7, so the second token is needed, not the third
    assert probs[:2].sum() >= 0.7
    tiny_p = filtered_logits(LOGITS, SamplingParams(top_p=1e-6))
    assert torch.isfinite(tiny_p).sum() == 1  # the top token always survives


def test_seeded_sampling_reproduces_and_respects_support() -> None:
    params = SamplingParams(temperature=1.0, top_k=3, seed=1234)

    def draw() -> list[int]:
        return [sample(LOGITS, params, DrawKey(1234, 0, t)).token_id for t in range(200)]

    first = draw()
    assert first == draw()
    assert set(first) <= {0, 1, 2}
    assert len(set(first)) == 3  # temperature 1 over three tokens: all appear in 200 draws


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_tokens=0),
        dict(temperature=-1),
        dict(temperature=3),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(logprobs=21),
    ],
)
def test_invalid_params_raise(bad: dict) -> None:
    with pytest.raises(SamplingError):
        SamplingParams(**bad)


def test_finish_reason_is_the_one_stop_rule() -> None:
    eos = {7}
    p = SamplingParams(max_tokens=3, stop_token_ids=(5,))
    assert p.finish_reason(1, 1, eos) is None
    assert p.finish_reason(5, 1, eos) == "stop"  # a stop id
    assert p.finish_reason(7, 1, eos) == "stop"  # EOS
    assert p.finish_reason(7, 3, eos) == "stop"  # a stop wins over the length limit
    assert p.finish_reason(1, 3, eos) == "length"
    assert p.finish_reason(1, 2, eos, limit=2) == "length"  # the engine's reserved limit
    ignoring = SamplingParams(max_tokens=3, ignore_eos=True)
    assert ignoring.finish_reason(7, 1, eos) is None


def test_a_batch_samples_each_row_as_alone_and_seeds_ignore_the_company() -> None:
    """`sample_batch` gives each row what `sample` gives it alone (greedy, filtered and
    seeded draws, logprobs), whichever rows share the batch."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, top_k=5, seed=7, logprobs=1),
        SamplingParams(temperature=1.3, top_p=0.5, seed=11),
        SamplingParams(temperature=1.0, top_k=10, top_p=0.9, seed=3, logprobs=2),
    ]
    keys = [DrawKey(p.seed or 0, 1, 9) for p in params]
    alone = [sample(logits[b], p, keys[b]) for b, p in enumerate(params)]
    together = sample_batch(logits, params, keys)
    assert together == alone
    # The seeded row draws the same token in another company and order.
    shuffled = sample_batch(
        logits[[3, 1]],
        [params[3], params[1]],
        [keys[3], keys[1]],
    )
    assert shuffled == [alone[3], alone[1]]
    for b, p in enumerate(params):
        kept = torch.isfinite(filtered_logits(logits[b], p)) if not p.greedy else None
        assert kept is None or kept[together[b].token_id]
        assert len(together[b].top_logprobs) == p.logprobs
