"""TPLA shard math: one latent group is exactly MLA; shard constants; head-group sums."""

from __future__ import annotations

import pytest
import torch

from common.loading.loader import load_model
from common.model.tpla import (
    head_output,
    latent_shards,
    new_token_latent,
    shard_attention,
)
from common.parallel import ParallelConfig, RmsNormMode
from tests.tiny import save_hf


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("tpla-math")
    save_hf("v2-greedy", path, std=0.05)
    return load_model(path)


def _inputs(model, t: int = 24):
    attn = model.model.layers[1].self_attn
    h = torch.randn(t, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    cos, sin = model.rope.cos_sin(torch.arange(t))
    q_nope, q_pe = attn.queries(h, model.rope, cos, sin)
    n, k_pe = attn.latents(h, model.rope, cos, sin)
    valid = torch.ones(t, t, dtype=torch.bool).tril()[None]
    return attn, h, q_nope[None], q_pe[None], n[None], k_pe[None], valid, (cos, sin)


def test_one_group_with_head_groups_equals_mla(model) -> None:
    attn, _, q_nope, q_pe, n, k_pe, valid, _ = _inputs(model)
    reference = attn.output(attn.absorbed(q_nope, q_pe, n, k_pe, valid)[0])
    (shard,) = latent_shards(ParallelConfig(1, 1).latent_slices(attn.d_c))
    assert shard.beta == 1.0 and shard.rms_correction == 1.0
    total = torch.zeros_like(reference)
    for heads in (slice(0, 2), slice(2, 4)):  # m = 2 head groups, as on two MLA-TP ranks
        o = shard_attention(
            attn, q_nope[:, :, heads], q_pe[:, :, heads], n, k_pe, valid, shard, heads
        )
        total += head_output(attn, o[0], heads)
    torch.testing.assert_close(total, reference, atol=1e-6, rtol=0)


def test_slices_with_unit_beta_partition_the_scores(model) -> None:
    """With beta = 1 and no softmax (one key), the slices' outputs sum to MLA's."""
    attn, _, q_nope, q_pe, n, k_pe, _, _ = _inputs(model, t=1)
    valid = torch.ones(1, 1, 1, dtype=torch.bool)
    reference = attn.output(attn.absorbed(q_nope, q_pe, n, k_pe, valid)[0])
    total = sum(
        head_output(
            attn,
            shard_attention(
                attn, q_nope, q_pe, n[..., s.start : s.end], k_pe, valid, s, slice(None), beta=1.0
            )[0],
            slice(None),
        )
        for s in latent_shards(ParallelConfig(4, 4).latent_slices(attn.d_c))
    )
    torch.testing.assert_close(total, reference, atol=1e-6, rtol=0)


def test_shard_energies_from_spectrum() -> None:
    spectrum = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.5, 0.3, 0.1, 0.1])
    shards = latent_shards(ParallelConfig(2, 2).latent_slices(8), spectrum)
    assert [s.energy for s in shards] == pytest.approx([10 / 11, 1 / 11])
    assert shards[0].rms_correction == pytest.approx((1 / (2 * 10 / 11)) ** 0.5)
    assert [s.energy for s in latent_shards(ParallelConfig(4, 4).latent_slices(8))] == [0.25] * 4
    with pytest.raises(ValueError, match="divisible"):
        latent_shards(ParallelConfig(3, 3).latent_slices(8))


def test_rmsnorm_modes(model) -> None:
    attn, h, *_, (cos, sin) = _inputs(model)
    n_full, k_pe = attn.latents(h, model.rope, cos, sin)
    shards = latent_shards(ParallelConfig(2, 2).latent_slices(attn.d_c))
    exact = [new_token_latent(attn, h, s, RmsNormMode.EXACT, k_pe)[0] for s in shards]
    torch.testing.assert_close(torch.cat(exact, -1), n_full)
    (whole,) = latent_shards(ParallelConfig(1, 1).latent_slices(attn.d_c))
    sliced_one = new_token_latent(attn, h, whole, RmsNormMode.SLICED, k_pe)[0]
    torch.testing.assert_close(sliced_one, n_full, atol=1e-6, rtol=0)  # r = 1: sliced is exact
    sliced = torch.cat(
        [new_token_latent(attn, h, s, RmsNormMode.SLICED, k_pe)[0] for s in shards], -1
    )
    assert not torch.allclose(sliced, n_full)  # r = 2: an estimate, not the exact norm
