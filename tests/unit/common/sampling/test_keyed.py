"""Keyed draws: the integer hash against plain Python, the noise's distribution, and the keyed
sampler's per-position marginals on a tiny model against the model's own distribution."""

from __future__ import annotations

from pathlib import Path

import torch

from common.loading.loader import load_model
from common.sampling.keyed import (
    DrawKey,
    exponential_from_bits,
    exponential_noise,
    key_words,
    mix32,
    uniform_bits,
)
from common.sampling.params import SamplingParams
from common.sampling.sampler import sample_batch
from tests.tiny import save_hf

CPU = torch.device("cpu")


def _mix32_reference(x: int) -> int:
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & m
    x ^= x >> 15
    x = (x * 0x735A2D97) & m
    return x ^ (x >> 15)


def test_mix32_is_the_plain_integer_hash() -> None:
    values = [0, 1, 2, 0xFFFFFFFF, 0x80000000, 12345, *range(1000, 1100)]
    got = mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert len(set(got)) == len(values)  # a bijection
    assert got == [_mix32_reference(v) for v in values]


def test_a_key_is_its_draw_whatever_the_company() -> None:
    keys = [DrawKey(7, 0, 3), DrawKey(-5, 2, 40), DrawKey(2**63 - 1, 1, 0)]
    together = uniform_bits(key_words(keys, CPU), 50)
    for b, key in enumerate(keys):
        assert torch.equal(uniform_bits(key_words([key], CPU), 50)[0], together[b])
    # Any change of seed, choice or position is another draw.
    near = [DrawKey(8, 0, 3), DrawKey(7, 1, 3), DrawKey(7, 0, 4)]
    for row in uniform_bits(key_words(near, CPU), 50):
        assert not torch.equal(row, together[0])


def test_the_noise_is_exponential() -> None:
    keys = [DrawKey(seed, 0, 9) for seed in range(400)]
    noise = exponential_noise(key_words(keys, CPU), 100).double()
    assert noise.min() > 0
    # Exp(1): mean 1 and variance 1; 40,000 draws put each within about 0.02.
    assert abs(noise.mean().item() - 1) < 0.03
    assert abs(noise.var().item() - 1) < 0.08
    # P(E > 1) = e^-1, and columns are alike (no column-dependent bias).
    assert abs((noise > 1).double().mean().item() - torch.exp(torch.tensor(-1.0)).item()) < 0.01
    assert (noise.mean(0) - 1).abs().max() < 0.25


def test_the_noise_is_never_zero_so_a_token_of_probability_zero_is_never_drawn() -> None:
    # The extreme bits: the top one once rounded to u = 1 (noise 0), and a masked token's
    # weight 0 / 0 = NaN won the race (one draw in 2^24 per column: a V = 129K vocabulary
    # drew a masked token in about 1 sampled step of 130).
    bits = torch.tensor([0, 255, 2**32 - 256, 2**32 - 1], dtype=torch.int64)
    noise = exponential_from_bits(bits.clone())
    assert torch.isfinite(noise).all() and (noise > 0).all()
    weights = torch.tensor([[0.0, 0.0, 0.25, 0.0]])  # only column 2 may be drawn
    for column in range(4):
        row = torch.full((1, 4), 1.0)
        row[0, column] = exponential_from_bits(torch.tensor([2**32 - 1]))[0]
        assert (weights / row).argmax(-1).item() == 2


def test_keyed_marginals_match_the_models_distribution(tmp_path: Path) -> None:
    """Over many seeds, the token the keyed sampler draws at each position of a fixed
    context has the model's probabilities. Bound: every token's frequency within 5
    binomial standard errors of its probability (a false alarm ~1e-6 per token), and the
    total variation distance under 0.03."""
    save_hf("v2-greedy", tmp_path, vocab_size=24, std=0.3)
    model = load_model(tmp_path)
    context = torch.tensor([3, 17, 5, 9, 21, 2, 11])
    with torch.no_grad():
        logits = model.prefill(context, [len(context)], all_logits=True).logits
    seeds = 40_000
    params = SamplingParams(temperature=1.0)
    draws = []
    for t in range(3, len(context)):
        row = logits[t][None].expand(seeds, -1)
        keys = [DrawKey(s, 0, t + 1) for s in range(seeds)]
        tokens = torch.tensor([x.token_id for x in sample_batch(row, [params] * seeds, keys)])
        draws.append(tokens)
        p = logits[t].double().softmax(-1)
        freq = torch.bincount(tokens, minlength=p.numel()).double() / seeds
        stderr = (p * (1 - p) / seeds).sqrt().clamp(min=1e-9)
        assert ((freq - p).abs() <= 5 * stderr + 1e-9).all(), (t, freq, p)
        assert 0.5 * (freq - p).abs().sum() < 0.03
    # Positions draw apart: one position's token says nothing about the next one's.
    a, b = (draws[0] == draws[0].mode().values), (draws[1] == draws[1].mode().values)
    pa, pb = a.double().mean(), b.double().mean()
    joint = (a & b).double().mean()
    assert abs(joint - pa * pb) < 5 * (pa * pb * (1 - pa * pb) / seeds).sqrt()
