"""Exact MLA reparameterization (DESIGN §1): fold gamma, rotate the latent, record spectra.

Per layer, with an orthogonal R and the kv_a_layernorm weight gamma:

    W_kvb <- W_kvb diag(gamma) R,   gamma <- 1,   W_kva[:d_c] <- R^T W_kva[:d_c]

rms is rotation invariant, so MLA's outputs are unchanged and the cached latent becomes
`R^T x / rms(x)`. The result is either written as a new HF checkpoint
(common/tpla/rotated_checkpoint.py) or recorded in a small side file that
`apply_reparameterization` replays at load time. A side file also carries each layer's
calibration spectrum in the rotated basis, from which `common.model.tpla.latent_shard`
derives the per-shard constants for any TP degree.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor

from common.loading.side_file import (
    LayerReparameterization,
    Method,
    Reparameterization,
    SideFileError,
    basis_rotations,
    fingerprint,
    load_side_file,
    side_file_name,
)
from common.loading.weights import rotate_kv_a, rotate_kv_b
from common.model.args import ModelConfig
from common.model.causal_lm import DeepseekForCausalLM
from common.model.mla import MLAttention
from common.tpla.calibration import LatentStatistics
from common.tpla.transforms import rotated_spectrum, rotation

log = logging.getLogger(__name__)


def model_fingerprint(model: DeepseekForCausalLM) -> str:
    return fingerprint([layer.self_attn.kv_a_proj_with_mqa.weight for layer in model.model.layers])


def reparameterized_weights(
    kv_a: Tensor, gamma: Tensor, kv_b: Tensor, r: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Fold gamma and rotate one layer's (kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj).

    Computed in float64 and returned in each input's dtype. The rope rows of kv_a (after
    the first d_c) are untouched.
    """
    return rotate_kv_a(kv_a, r), torch.ones_like(gamma), rotate_kv_b(kv_b, gamma, r)


def _reparameterize_attention(attn: MLAttention, r: Tensor) -> None:
    with torch.no_grad():
        a, g, b = reparameterized_weights(
            attn.kv_a_proj_with_mqa.weight,
            attn.kv_a_layernorm.weight,
            attn.kv_b_proj.weight,
            r.to(attn.kv_b_proj.weight.device),
        )
        attn.kv_a_proj_with_mqa.weight.copy_(a)
        attn.kv_a_layernorm.weight.copy_(g)
        attn.kv_b_proj.weight.copy_(b)


def fold_gamma(model: DeepseekForCausalLM) -> None:
    """Fold every kv_a_layernorm weight into kv_b_proj (exact; R = identity)."""
    eye = torch.eye(model.config.kv_lora_rank, dtype=torch.float64)
    for layer in model.model.layers:
        _reparameterize_attention(layer.self_attn, eye)


def build_reparameterization(
    model: DeepseekForCausalLM, method: Method, stats: LatentStatistics, *, seed: int = 0
) -> Reparameterization:
    """R and rotated spectra for every layer of `model` (unrotated) from its latent statistics."""
    return reparameterization_from(model.config, model_fingerprint(model), method, stats, seed=seed)


def reparameterization_from(
    config: ModelConfig,
    weights: str,
    method: Method,
    stats: LatentStatistics,
    *,
    seed: int = 0,
) -> Reparameterization:
    """R and rotated spectra for every layer of a model of `config` whose kv_a weights have
    the fingerprint `weights` (unrotated), from its latent statistics."""
    d_c = config.kv_lora_rank
    moments = stats.second_moments()
    if len(moments) - stats.mtp_layers != config.num_hidden_layers:
        raise SideFileError("calibration statistics do not match the model's layer count")
    layers = []
    for index, c in enumerate(moments):
        # Each layer gets its own Hadamard signs: seed + layer keeps them reproducible.
        r = rotation(method, d_c, seed=seed + index, second_moment=c)
        # E[n_k^2] >= 0; a latent wider than the hidden state (rank-deficient C) rounds its
        # zero directions to about -1e-16, which the side file would refuse.
        spectrum = rotated_spectrum(r, c).clamp(min=0)
        layers.append(LayerReparameterization(None if method is Method.IDENTITY else r, spectrum))
    return Reparameterization(
        method=method,
        seed=seed,
        kv_lora_rank=d_c,
        layers=tuple(layers),
        rotation_applied=False,
        fingerprint=weights,
        calibration_tokens=stats.tokens,
        calibration_source=stats.source,
        mtp_layers=stats.mtp_layers,
    )


def apply_reparameterization(model: DeepseekForCausalLM, side: Reparameterization) -> list[Tensor]:
    """Fold gamma and apply each layer's R to `model` in place; return the spectra per layer.

    A side file of a converted checkpoint (`rotation_applied`) only checks that gamma is
    already folded.
    """
    layers = model.model.layers
    rotations = basis_rotations(
        side,
        model.config,
        [layer.self_attn.kv_a_proj_with_mqa.weight for layer in layers],
        lambda i: layers[i].self_attn.kv_a_layernorm.weight,
    )
    for layer, r in zip(layers, rotations or [], strict=False):
        _reparameterize_attention(layer.self_attn, r)
    return side.spectra()


# -- side file I/O ----------------------------------------------------------------------------


def load_reparameterization(
    model: DeepseekForCausalLM, model_dir: str | Path, method: Method
) -> list[Tensor | None]:
    """Apply the model dir's side file for `method`; spectra per layer.

    Without a side file the latent stays in the checkpoint's basis (gamma is still folded,
    which is exact) and every shard gets e_i = 1/r: a warning says so.
    """
    path = Path(model_dir) / side_file_name(method)
    if path.is_file():
        return list(apply_reparameterization(model, load_side_file(path)))
    log.warning(
        "no TPLA side file %s: falling back to the identity basis with e_i = 1/r "
        "(uncalibrated); run `tpla convert --model %s --method %s` to create it",
        path,
        model_dir,
        method.value,
    )
    fold_gamma(model)
    return [None] * model.config.num_hidden_layers
