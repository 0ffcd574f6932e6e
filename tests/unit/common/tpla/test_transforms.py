"""Latent transforms: orthogonality, determinism, PCA ordering, Hadamard energy spreading."""

from __future__ import annotations

import pytest
import torch

from common.loading.side_file import Method
from common.model.causal_lm import DeepseekForCausalLM
from common.model.tpla import latent_shards
from common.parallel import ParallelConfig
from common.tpla.convert import build_reparameterization
from common.tpla.transforms import (
    TransformError,
    pca_basis,
    random_hadamard,
    rotated_spectrum,
    rotation,
)
from tests.tiny import calibrate


def _psd(d: int, seed: int = 0) -> torch.Tensor:
    a = torch.randn(4 * d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    a = a * torch.logspace(0, -2, d, dtype=torch.float64)  # anisotropic, like real latents
    return a.T @ a / a.shape[0]


@pytest.mark.parametrize("method", list(Method))
@pytest.mark.parametrize("d", [8, 32, 128])
def test_every_transform_is_orthogonal(method: Method, d: int) -> None:
    r = rotation(method, d, seed=3, second_moment=_psd(d))
    assert r.dtype == torch.float64 and r.shape == (d, d)
    torch.testing.assert_close(r.T @ r, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)


def test_hadamard_is_seeded_and_needs_a_power_of_two() -> None:
    torch.testing.assert_close(random_hadamard(16, 5), random_hadamard(16, 5), atol=0, rtol=0)
    assert not torch.equal(random_hadamard(16, 5), random_hadamard(16, 6))
    assert torch.allclose(
        random_hadamard(16, 5).abs(), torch.full((16, 16), 0.25, dtype=torch.float64)
    )
    with pytest.raises(TransformError, match="power-of-two latent width, got d_c = 24"):
        rotation(Method.HADAMARD, 24)


def test_pca_spectrum_is_descending_eigenvalues() -> None:
    c = _psd(32)
    vectors, values = pca_basis(c)
    assert torch.all(values[:-1] >= values[1:])
    spectrum = rotated_spectrum(vectors, c)
    torch.testing.assert_close(spectrum, values, atol=1e-12, rtol=0)
    torch.testing.assert_close(spectrum.sum(), torch.trace(c), atol=1e-12, rtol=0)
    with pytest.raises(TransformError, match="pca needs calibration"):
        rotation(Method.PCA, 32)


def test_hadamard_spreads_diagonal_energy_exactly() -> None:
    """For uncorrelated latents, every Hadamard coordinate gets exactly trace / d."""
    c = torch.diag(torch.logspace(0, -3, 64, dtype=torch.float64))
    spectrum = rotated_spectrum(random_hadamard(64, 0), c)
    torch.testing.assert_close(spectrum, torch.full_like(spectrum, float(torch.trace(c)) / 64))
    assert float(torch.diagonal(c)[:32].sum() / torch.trace(c)) > 0.95  # identity: lopsided


def test_methods_on_a_model_with_structured_latents(tiny_model: DeepseekForCausalLM) -> None:
    """Real calibration: PCA concentrates energy in shard 0, Hadamard evens it out."""
    d_c = tiny_model.config.kv_lora_rank
    with torch.no_grad():  # make a few latent directions dominate, as in trained models
        for layer in tiny_model.model.layers:
            w = layer.self_attn.kv_a_proj_with_mqa.weight
            w[:d_c] *= torch.logspace(0, -1.5, d_c)[:, None]
    stats = calibrate(tiny_model)
    energies = {}
    for method in Method:
        side = build_reparameterization(tiny_model, method, stats, seed=0)
        energies[method] = {
            r: [
                [s.energy for s in latent_shards(ParallelConfig(r, r).latent_slices(d_c), sp)]
                for sp in side.spectra()
            ]
            for r in (2, 4)
        }
        if method is Method.PCA:
            for spectrum in side.spectra():
                assert torch.all(spectrum[:-1] >= spectrum[1:])
    for layer in range(tiny_model.config.num_hidden_layers):
        identity, hadamard, pca = (energies[m][2][layer] for m in Method)
        assert identity[0] > 0.8  # the checkpoint's basis is lopsided
        assert pca[0] >= identity[0] - 1e-12  # PCA's leading shard holds the most energy
        for r in (2, 4):
            assert energies[Method.HADAMARD][r][layer] == pytest.approx([1 / r] * r, abs=0.05)
        assert hadamard[0] == pytest.approx(0.5, abs=0.05)
