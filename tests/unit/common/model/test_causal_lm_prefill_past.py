"""Prefill over a cached prefix (`PastLatents`) against a prefill of the whole prompt."""

from __future__ import annotations

import pytest
import torch

from common.loading.loader import load_model
from common.model.causal_lm import PastLatents
from tests.tiny import save_hf


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("past-model")
    save_hf("v2-group-yarn", out, std=0.08)
    return load_model(out)


@pytest.mark.parametrize("absorbed", [False, True])
def test_prefill_over_cached_latents_equals_a_full_prefill(model, absorbed: bool) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 90, (n,), generator=g) for n in (37, 21, 16)]
    full = model.prefill(torch.cat(prompts), [len(p) for p in prompts], all_logits=True)
    cuts = [24, 0, 15]  # the first two continue a cached prefix, the last computes one token
    starts = [0, 37, 58]
    pasts = []
    for prompt, cut in zip(prompts, cuts, strict=True):
        if not cut:
            pasts.append(None)
            continue
        alone = model.prefill(prompt[:cut], [cut])  # as the cache would have kept it
        pasts.append(PastLatents(alone.n, alone.k_pe))
    new = [p[c:] for p, c in zip(prompts, cuts, strict=True)]
    out = model.prefill(
        torch.cat(new), [len(p) for p in new], past=pasts, absorbed=absorbed, all_logits=True
    )
    row = 0
    for prompt, cut, s in zip(prompts, cuts, starts, strict=True):
        q = len(prompt) - cut
        want = full.logits[s + cut : s + len(prompt)]
        got = out.logits[row : row + q]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        assert torch.equal(got[-1].argmax(), want[-1].argmax())  # the first token
        for layer in range(len(out.n)):
            torch.testing.assert_close(
                out.n[layer][row : row + q], full.n[layer][s + cut : s + len(prompt)]
            )
        row += q
