"""Rotary position embedding for the decoupled rope part of MLA, with YaRN.

Both checkpoint layouts produce the same output layout: the rotated vector is returned as
`[x_even_rotated | x_odd_rotated]` halves. Only dot products between rotated queries and
keys matter, so a consistent output layout is all the cache needs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from common.model.args import ModelConfig, YarnScaling


def _yarn_correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_inv_freq(dim: int, base: float, yarn: YarnScaling) -> Tensor:
    """Blend interpolated and extrapolated frequencies with YaRN's linear ramp."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    extrapolated = 1.0 / (base**exponents)
    interpolated = 1.0 / (yarn.factor * base**exponents)
    low = max(
        math.floor(
            _yarn_correction_dim(yarn.beta_fast, dim, base, yarn.original_max_position_embeddings)
        ),
        0,
    )
    high = min(
        math.ceil(
            _yarn_correction_dim(yarn.beta_slow, dim, base, yarn.original_max_position_embeddings)
        ),
        dim - 1,
    )
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    keep_extrapolated = 1.0 - ramp
    return interpolated * (1 - keep_extrapolated) + extrapolated * keep_extrapolated


class RotaryEmbedding:
    """cos/sin tables for positions, computed on demand from inv_freq (no max-length cache).

    Frequencies are computed on the CPU explicitly, so building a model under
    `torch.device("meta")` (as the loader does) still yields real tables.
    """

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        dim = config.qk_rope_head_dim
        if config.rope_scaling is None:
            exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
            inv_freq = 1.0 / (config.rope_theta**exponents)
            self.attention_factor = 1.0
        else:
            inv_freq = yarn_inv_freq(dim, config.rope_theta, config.rope_scaling)
            self.attention_factor = config.rope_scaling.rope_attention_factor
        self.inv_freq = inv_freq.to(device)
        self.interleaved = config.rope_interleave
        self.query_beta, self.query_period = config.query_scale_beta, config.query_scale_period

    def query_scale(self, positions: Tensor) -> Tensor | None:
        """Each query's factor [*positions.shape] in float32 where the model scales its
        queries by position (Mistral 4: 1 + beta ln(1 + floor(p / period))), else None.
        Scaling a query is scaling its softmax scale, so every attention path and kernel
        takes it through the queries (`scale_queries`)."""
        if not self.query_beta:
            return None
        blocks = torch.floor(positions.to(torch.float32) / self.query_period)
        return 1.0 + self.query_beta * torch.log1p(blocks)

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin of shape [*positions.shape, d_r / 2], in float32."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def apply(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate x [..., T, (heads,) d_r]; cos/sin broadcast as [T, 1, d_r/2] or [T, d_r/2]."""
        return rotate(x, cos, sin, self.interleaved)


def rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """x rotated by (cos, sin), its pairs laid out interleaved (x0, x1), (x2, x3), ... or as
    halves; the output is in halves either way (the module's docstring)."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    x1f, x2f = x1.float(), x2.float()
    out = torch.cat((x1f * cos - x2f * sin, x2f * cos + x1f * sin), dim=-1)
    return out.to(x.dtype)


def scale_queries(q_nope: Tensor, q_pe: Tensor, scale: Tensor | None) -> tuple[Tensor, Tensor]:
    """q_nope [T, h, d_n] and rotated q_pe [T, h, d_r] times each row's query factor [T]
    (`RotaryEmbedding.query_scale`; None: unchanged)."""
    if scale is None:
        return q_nope, q_pe
    s = scale.to(q_nope.dtype)[:, None, None]
    return q_nope * s, q_pe * s
