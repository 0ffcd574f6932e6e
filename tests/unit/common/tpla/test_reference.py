"""The oracle: r = 1 is MLA, teacher forcing equals token-by-token decode, PD and GLA."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor

from common.loading.side_file import Method
from common.model.causal_lm import DeepseekForCausalLM
from common.model.tpla import latent_shards
from common.parallel import ParallelConfig, RmsNormMode
from common.tpla.convert import apply_reparameterization, build_reparameterization
from common.tpla.reference import AttentionSpec, ReferenceModel, Variant
from tests.tiny import calibrate, random_windows

T, P = 40, 12


def _token_by_token(oracle: ReferenceModel, ids: Tensor, prompt: int) -> Tensor:
    state = oracle.start()
    logits = [oracle.prefill(state, ids[:prompt])]
    logits += [oracle.decode(state, int(t))[None] for t in ids[prompt:]]
    return torch.cat(logits)


def _pca_model(model: DeepseekForCausalLM) -> tuple[DeepseekForCausalLM, list[Tensor]]:
    rotated = copy.deepcopy(model)
    spectra = apply_reparameterization(
        rotated, build_reparameterization(model, Method.PCA, calibrate(model))
    )
    return rotated, spectra


@pytest.mark.parametrize("variant", [Variant.TPLA, Variant.TPLA_PD, Variant.GLA])
@pytest.mark.parametrize("mode", list(RmsNormMode))
def test_one_latent_group_is_mla_in_both_entry_points(
    tiny_model: DeepseekForCausalLM, variant: Variant, mode: RmsNormMode
) -> None:
    (ids,) = random_windows(1, T, tiny_model.config.vocab_size)
    mla = tiny_model.prefill(ids, [T], all_logits=True).logits
    oracle = ReferenceModel(tiny_model, AttentionSpec(variant, 1, mode))
    torch.testing.assert_close(oracle.forward(ids, prefill_len=P), mla, atol=1e-5, rtol=0)
    torch.testing.assert_close(_token_by_token(oracle, ids, P), mla, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "spec",
    [
        AttentionSpec(Variant.TPLA, 2, RmsNormMode.SLICED),
        AttentionSpec(Variant.TPLA, 4, RmsNormMode.EXACT),
        AttentionSpec(Variant.TPLA_PD, 2, RmsNormMode.SLICED),
        AttentionSpec(Variant.GLA, 2),
        AttentionSpec(Variant.MLA),
    ],
    ids=lambda s: f"{s.variant.value}-r{s.groups}-{s.rmsnorm.value}",
)
def test_teacher_forcing_equals_token_by_token(
    tiny_model: DeepseekForCausalLM, spec: AttentionSpec
) -> None:
    model, spectra = _pca_model(tiny_model)
    (ids,) = random_windows(1, T, model.config.vocab_size, seed=1)
    oracle = ReferenceModel(model, spec, spectra)
    forced = oracle.forward(ids, prefill_len=P)
    torch.testing.assert_close(_token_by_token(oracle, ids, P), forced, atol=1e-5, rtol=0)
    mla = tiny_model.prefill(ids, [T], all_logits=True).logits
    if spec.variant is Variant.MLA:
        torch.testing.assert_close(forced, mla, atol=1e-5, rtol=0)
    else:
        assert (forced - mla).abs().max() > 1e-3  # r > 1 really is an approximation


def test_pd_separation(tiny_model: DeepseekForCausalLM) -> None:
    model, spectra = _pca_model(tiny_model)
    (ids,) = random_windows(1, T, model.config.vocab_size, seed=2)
    mla = tiny_model.prefill(ids, [T], all_logits=True).logits
    pd = ReferenceModel(model, AttentionSpec(Variant.TPLA_PD, 2, RmsNormMode.SLICED), spectra)
    torch.testing.assert_close(pd.forward(ids, prefill_len=T), mla, atol=1e-5, rtol=0)
    partial = pd.forward(ids, prefill_len=P)
    torch.testing.assert_close(partial[:P], mla[:P], atol=1e-5, rtol=0)  # the exact prompt
    assert (partial[P:] - mla[P:]).abs().max() > 1e-3
    # Plain TPLA slices the prompt too, so it differs before P as well.
    tpla = ReferenceModel(model, AttentionSpec(Variant.TPLA, 2, RmsNormMode.SLICED), spectra)
    assert (tpla.forward(ids)[:P] - mla[:P]).abs().max() > 1e-3


def test_gla_differs_from_mla_and_tpla(tiny_model: DeepseekForCausalLM) -> None:
    (ids,) = random_windows(1, T, tiny_model.config.vocab_size, seed=3)
    mla = tiny_model.prefill(ids, [T], all_logits=True).logits
    gla = ReferenceModel(tiny_model, AttentionSpec(Variant.GLA, 2)).forward(ids)
    tpla = ReferenceModel(tiny_model, AttentionSpec(Variant.TPLA, 2)).forward(ids)
    gla_err, tpla_err = (gla - mla).abs().mean(), (tpla - mla).abs().mean()
    assert gla_err > 1e-2
    assert tpla_err < gla_err  # every head keeps the whole latent in TPLA


def test_bad_specs_are_clear_errors(tiny_model: DeepseekForCausalLM) -> None:
    with pytest.raises(ValueError, match="not divisible into 3 groups"):
        ReferenceModel(tiny_model, AttentionSpec(Variant.TPLA, 3))
    with pytest.raises(ValueError, match="groups must be >= 1"):
        AttentionSpec(Variant.TPLA, 0)
    oracle = ReferenceModel(tiny_model, AttentionSpec(Variant.TPLA, 2))
    with pytest.raises(ValueError, match="prefilled"):
        oracle.decode(oracle.start(), 3)


@pytest.mark.parametrize("groups", [2, 4])
def test_shard_constants_match_the_calibration_latents(
    tiny_model: DeepseekForCausalLM, groups: int
) -> None:
    """e_i, beta_i and the RMS correction equal direct sums over the cached latents."""
    windows = random_windows(3, 64, tiny_model.config.vocab_size)
    side = build_reparameterization(tiny_model, Method.PCA, calibrate(tiny_model))
    rotated = copy.deepcopy(tiny_model)
    spectra = apply_reparameterization(rotated, side)
    latents = [rotated.prefill(w, [len(w)]).n for w in windows]
    d_c = tiny_model.config.kv_lora_rank
    width = d_c // groups
    for layer, spectrum in enumerate(spectra):
        n = torch.cat([out[layer] for out in latents]).double()  # the cache: rotated x / rms(x)
        total = n.pow(2).sum()
        for shard in latent_shards(ParallelConfig(groups, groups).latent_slices(d_c), spectrum):
            part = n[:, shard.start : shard.end].pow(2).sum()
            assert shard.energy == pytest.approx(float(part / total), rel=1e-5)
            assert shard.beta == shard.energy
            direct_rms = ((total / d_c) / (part / width)).sqrt()
            assert shard.rms_correction == pytest.approx(float(direct_rms), rel=1e-5)
