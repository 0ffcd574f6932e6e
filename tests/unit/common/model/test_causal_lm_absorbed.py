"""Absorbed decode over a latent cache against expanded recompute, over a long context."""

from __future__ import annotations

import pytest
import torch

from common.loading.loader import load_model
from common.model.contiguous_cache import ContiguousLatentCache
from tests.tiny import save_hf

CONTEXT = 520
STEPS = 6


@pytest.mark.parametrize("variant", ["v2-greedy", "v3-noaux-yarn"])
def test_absorbed_decode_equals_expanded_recompute(tmp_path, variant: str) -> None:
    # Realistic init scale (HF's initializer_range): logits of order 1, as in trained models.
    save_hf(variant, tmp_path, std=0.02)
    model = load_model(tmp_path)
    ids = torch.randint(2, 160, (CONTEXT + STEPS,), generator=torch.Generator().manual_seed(0))
    reference = model.prefill(ids, [len(ids)], all_logits=True).logits

    out = model.prefill(ids[:CONTEXT], [CONTEXT])
    cache = ContiguousLatentCache(model.config, 1, CONTEXT + STEPS)
    cache.load_prefill(0, out, 0, CONTEXT)
    torch.testing.assert_close(out.logits[0], reference[CONTEXT - 1], atol=1e-5, rtol=0)
    for step in range(STEPS):
        pos = CONTEXT + step
        logits = model.decode(ids[pos : pos + 1], torch.tensor([pos]), cache)[0]
        torch.testing.assert_close(logits, reference[pos], atol=1e-5, rtol=0)


def test_batched_decode_with_ragged_lengths(tmp_path) -> None:
    """Rows of different lengths in one decode batch equal each row decoded alone."""
    save_hf("v3-noaux-yarn", tmp_path, std=0.02)
    model = load_model(tmp_path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 160, (n,), generator=gen) for n in (9, 30, 17)]
    out = model.prefill(torch.cat(prompts), [len(p) for p in prompts])
    cache = ContiguousLatentCache(model.config, 3, 40)
    start = 0
    for row, p in enumerate(prompts):
        cache.load_prefill(row, out, start, start + len(p))
        start += len(p)
    nxt = torch.tensor([5, 6, 7])
    positions = torch.tensor([len(p) for p in prompts])
    batched = model.decode(nxt, positions, cache)
    for row, p in enumerate(prompts):
        full = model.prefill(torch.cat([p, nxt[row : row + 1]]), [len(p) + 1]).logits[0]
        torch.testing.assert_close(batched[row], full, atol=1e-5, rtol=0)
