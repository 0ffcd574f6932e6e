"""TPLA: attention over one contiguous slice of the (rotated) latent, per DESIGN §1.

Rank (i, j) of a decode group holds `n_t[S_i]` and the replicated `k_pe_t`, and the heads of
group j. It computes

    s^h_{i,t} = scale * (q~^h[S_i] . n_t[S_i] / beta_i + q_pe^h . k_pe_t)
    u^h_i     = sum_t softmax_t(s^h_i) n_t[S_i]
    y_i,j     = sum_{h in group j} W_o^h W_UV^h[:, S_i] u^h_i

and the group all-reduces y. With one latent group (r = 1, beta = 1) this is exactly MLA.
The single-process oracle and the distributed engine both call `shard_attention`, so there is
one implementation of the math. GLA (head group i sees only S_i, no beta) is here too, as
the lossy baseline of the paper's comparison.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from common.model.mla import MLAttention, rms_norm
from common.parallel import RmsNormMode


@dataclass(frozen=True)
class LatentShard:
    """Slice i of r of the latent and the constants derived for it."""

    index: int
    groups: int
    start: int
    end: int
    energy: float  # e_i: this slice's share of E[|n|^2] (1/r without calibration)

    @property
    def beta(self) -> float:
        """Softmax slicing factor: the partial score is rescaled to estimate the full one."""
        return self.energy if self.groups > 1 else 1.0

    @property
    def rms_correction(self) -> float:
        """rms(x) / rms(x[S_i]) in expectation: sqrt(1 / (r e_i))."""
        return math.sqrt(1.0 / (self.groups * self.energy)) if self.groups > 1 else 1.0

    @property
    def width(self) -> int:
        return self.end - self.start


def latent_shard(columns: slice, groups: int, spectrum: Tensor | None = None) -> LatentShard:
    """Latent slice S_i = `columns`, one of `groups` equal contiguous slices (the layout cuts
    them: `ParallelConfig.latent_columns`), with its energy share e_i.

    `spectrum` holds E[n_k^2] per latent dimension in the (rotated) basis the cache uses;
    without it every slice gets e_i = 1/r.
    """
    width = columns.stop - columns.start
    d_c = width * groups
    if spectrum is None:
        energy = 1.0 / groups
    else:
        if spectrum.shape != (d_c,):
            raise ValueError(f"spectrum has shape {tuple(spectrum.shape)}, expected ({d_c},)")
        total = float(spectrum.double().sum())
        energy = float(spectrum[columns].double().sum()) / total
    return LatentShard(columns.start // width, groups, columns.start, columns.stop, energy)


def latent_shards(slices: list[slice], spectrum: Tensor | None = None) -> list[LatentShard]:
    """`latent_shard` of each of S_1 .. S_r (`ParallelConfig.latent_slices`), in order."""
    return [latent_shard(columns, len(slices), spectrum) for columns in slices]


def sliced_rmsnorm(
    x_slice: Tensor, gamma_slice: Tensor, eps: float, rms_correction: float
) -> Tensor:
    """RMSNorm of a latent slice using only that slice: rms(x) ~ rms(x[S_i]) * correction."""
    xf = x_slice.float()
    rms = torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return gamma_slice * (xf / (rms * rms_correction)).to(x_slice.dtype)


def latent_norm(
    gamma: Tensor, eps: float, shard: LatentShard, mode: RmsNormMode
) -> Callable[[Tensor], Tensor]:
    """How rank i normalizes new tokens' latents (what `project_latent` gets as `norm`):

    exact: the whole pre-norm latent [T, d_c] normalized, then its slice S_i kept;
    sliced: its pre-norm slice x[S_i] normalized alone (`sliced_rmsnorm`).
    """
    if mode is RmsNormMode.EXACT:
        return lambda lat: rms_norm(lat, gamma, eps)[..., shard.start : shard.end]
    gamma_slice = gamma[shard.start : shard.end]
    return lambda lat: sliced_rmsnorm(lat, gamma_slice, eps, shard.rms_correction)


def new_token_latent(
    attn: MLAttention, h: Tensor, shard: LatentShard, mode: RmsNormMode, rope_k: Tensor
) -> tuple[Tensor, Tensor]:
    """Latent slice n[S_i] and rotated k_pe of new tokens h [T, D] on rank i.

    `rope_k` is the already-rotated k_pe (computed from the shared rope columns), so only the
    normalization differs between modes.
    """
    w = attn.kv_a_proj_with_mqa.weight
    rows = slice(0, attn.d_c) if mode is RmsNormMode.EXACT else slice(shard.start, shard.end)
    norm = latent_norm(attn.kv_a_layernorm.weight, attn.kv_a_layernorm.eps, shard, mode)
    return norm(torch.nn.functional.linear(h, w[rows])), rope_k


def latent_slice_attention(
    q_nope: Tensor,
    q_pe: Tensor,
    n_slice: Tensor,
    k_pe: Tensor,
    valid: Tensor,
    w_uk: Tensor,
    w_uv: Tensor,
    scale: float,
    beta: float,
) -> Tensor:
    """The TPLA kernel on explicit weight slices (what a decode rank holds).

    w_uk [h, d_n, |S_i|], w_uv [h, d_v, |S_i|]; other shapes as in `shard_attention`.
    """
    q_lat = torch.einsum("bqhn,hnc->bqhc", q_nope, w_uk)
    scores = torch.einsum("bqhc,btc->bqht", q_lat, n_slice)
    if beta != 1.0:
        scores = scores / beta
    scores = (scores + torch.einsum("bqhr,btr->bqht", q_pe, k_pe)) * scale
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(n_slice.dtype)
    u = torch.einsum("bqht,btc->bqhc", probs, n_slice)
    return torch.einsum("bqhc,hvc->bqhv", u, w_uv)


# exp(s - max) is floored at e^-_EXP_FLOOR in `fused_slice_attention` (see there).
_EXP_FLOOR = 30.0


def absorbed_queries(
    q_nope: Tensor, q_pe: Tensor, w_uk: Tensor, scale: float, beta: float
) -> Tensor:
    """[q~ * scale / beta | q_pe * scale] as one [B, h, |S_i| + d_r] query.

    q_nope [B, h, d_n], q_pe [B, h, d_r], w_uk [h, d_n, |S_i|]. Folding scale and beta into
    the query (B*h*(w + d_r) multiplies) instead of the scores (B*h*T) and keeping the two
    parts adjacent lets one matmul against the cache's [n | k_pe] rows give the final scores.
    """
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, h, w]
    return torch.cat((q_lat * (scale / beta), q_pe * scale), dim=-1)


def fused_slice_attention(
    q_nope: Tensor,
    q_pe: Tensor,
    read: Callable[[int, int], Tensor],
    total: int,
    chunk: int,
    lengths: Tensor,
    w_uk: Tensor,
    w_uv: Tensor,
    scale: float,
    beta: float,
) -> Tensor:
    """The fast TPLA / MLA-TP decode kernel; `latent_slice_attention` is its reference.

    q_nope [B, h, d_n], q_pe [B, h, d_r] (one query per sequence). `read(t0, t1)` returns
    cache rows [B, t1 - t0, |S_i| + d_r] with n[S_i] and k_pe adjacent per token (as
    `PagedLatentCache.rows` does), for t0 < t1 <= total on multiples of `chunk`; token t of
    sequence b is valid iff t < lengths[b] (>= 1). w_uk [h, d_n, |S_i|], w_uv [h, d_v, |S_i|].
    Returns W_UV^h[:, S_i] u^h_i as [B, h, d_v].

    Every product is a batched matmul with a contiguous reduction dimension: the scores are
    one bmm of the fused query against the cache rows, the values read the n columns of the
    same rows in place. Long caches go chunk by chunk (split-K, as in flash-decoding) so the
    second read of each chunk hits the CPU cache; the chunks' partial softmaxes are merged
    exactly with log-sum-exp.
    """
    b, h, _ = q_nope.shape
    width = w_uk.shape[-1]
    q = absorbed_queries(q_nope, q_pe, w_uk, scale, beta)
    # Every chunk is masked: which ones reach past a sequence's end is known only on the
    # device, and asking would make the host wait for it. Past the end the scores get -inf
    # (`bias`) and the weights' floor (see below) is -inf too, so they weigh exactly 0.
    acc = torch.promote_types(q.dtype, torch.float32)
    padding = torch.arange(total, device=q.device)[None, None] >= lengths[:, None, None]
    bias = torch.zeros(b, 1, total, dtype=acc, device=q.device).masked_fill_(padding, -math.inf)
    floor = torch.full_like(bias, -_EXP_FLOOR).masked_fill_(padding, -math.inf)
    starts = range(0, total, chunk)
    us = q.new_empty(len(starts), b, h, width)
    maxes = torch.empty(len(starts), b, h, dtype=acc, device=q.device)
    sums = torch.empty(len(starts), b, h, dtype=acc, device=q.device)
    for c, t0 in enumerate(starts):
        t1 = min(t0 + chunk, total)
        kv = read(t0, t1)
        s = torch.bmm(q, kv.transpose(1, 2)).to(acc)  # [B, h, C]
        s.add_(bias[..., t0:t1])
        m = s.amax(dim=-1, keepdim=True)
        maxes[c] = m[..., 0]
        # A sequence with no valid row here: its -inf max gives the chunk zero weight in the
        # merge; subtract a finite value instead so no NaN appears.
        m.clamp_(min=torch.finfo(acc).min)
        # Weights below e^-30 (under fp32 resolution of a sum that is >= 1) are raised to
        # e^-30: an exp that underflows into denormals, and a matmul fed denormals, take
        # microcode assists on x86 cores that made this kernel ~10x slower.
        torch.maximum(s.sub_(m), floor[..., t0:t1], out=s).exp_()
        sums[c] = s.sum(dim=-1)
        torch.bmm(s.to(q.dtype), kv[..., :width], out=us[c])
    if len(starts) == 1:
        u = us[0] / sums[0][..., None].to(q.dtype)
    else:
        weights = torch.exp(maxes - maxes.amax(dim=0))  # [chunks, B, h]; chunk 0 is valid
        u = (us * weights[..., None].to(q.dtype)).sum(dim=0)
        u = u / (weights * sums).sum(dim=0)[..., None].to(q.dtype)
    return torch.bmm(u.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def shard_attention(
    attn: MLAttention,
    q_nope: Tensor,
    q_pe: Tensor,
    n_slice: Tensor,
    k_pe: Tensor,
    valid: Tensor,
    shard: LatentShard,
    heads: slice,
    beta: float | None = None,
) -> Tensor:
    """Per-head values from one latent slice, for a subset of heads, from full weights.

    q_nope [B, Q, h, d_n], q_pe [B, Q, h, d_r] for the heads in `heads`; n_slice [B, T, |S_i|];
    k_pe [B, T, d_r]; valid [B, Q, T]. Returns W_UV^h[:, S_i] u^h_i as [B, Q, h, d_v]: summing
    its o_proj image over slices and head groups gives the layer output.
    """
    return latent_slice_attention(
        q_nope,
        q_pe,
        n_slice,
        k_pe,
        valid,
        attn.w_uk()[heads, :, shard.start : shard.end],
        attn.w_uv()[heads, :, shard.start : shard.end],
        attn.scale,
        shard.beta if beta is None else beta,
    )


def head_output(attn: MLAttention, o: Tensor, heads: slice) -> Tensor:
    """o_proj restricted to a head group: o [..., h, d_v] -> partial hidden [..., D]."""
    w_o = attn.o_proj.weight.view(attn.o_proj.weight.shape[0], attn.num_heads, attn.d_v)
    return torch.einsum("...hv,dhv->...d", o, w_o[:, heads])
