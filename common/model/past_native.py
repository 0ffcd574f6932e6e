"""The CPU fast path of a chunk's MLA attention over its cached past: the native kernel.

What `expanded_over_past` / `absorbed_over_past` (common/model/past_attention.py, the
reference) compute, for fp32 CPU tensors: the new tokens' queries over the past's keys in
tiles (no mask) and over their own keys (causal and square, offset 0), each a call of the
native causal kernel (common/native/causal_attention.cpp) that also returns every row's
log-sum-exp, merged by it. The kernel never holds a tile's scores, so a tile is bounded only
by the up-projected keys and values it needs (the expanded form) and by the kernel's per-head
copy of them: `NATIVE_TILE_ELEMENTS` floats. Against the reference's GEMM tiles, a chunk of
the bench's long-context model over its past runs at about the whole-prompt kernel's speed
per key (benchmarks/ttft.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from common.model.prefill_attention import PrefillAttention
from common.native import causal_attention

# Floats of one key tile's temporaries: the up-projected keys and values ([t, H, d_n + d_v],
# expanded form) or the kernel's packed copy of the shared latents (absorbed). 512K floats
# (2 MiB) are 2,048 keys of the bench's long-context model; a 1,024-query chunk over a 15K
# past ran within 3 % at 1,024 to 8,192 keys a tile, so the tile stays small.
NATIVE_TILE_ELEMENTS = 1 << 19
MIN_TILE = 256

# (first key, end key) of the past -> that tile's (k_a, k_b, v), each [t, H, *] or [t, *].
PastKeys = Callable[[int, int], tuple[Tensor, Tensor, Tensor]]


def usable(backend: PrefillAttention, *tensors: Tensor) -> bool:
    """Whether a model whose prefill backend is `backend` takes this path for `tensors`: only
    where it runs the native kernel for the whole prompt too, and the kernel's domain."""
    return backend.name == "native" and causal_attention.supports(*tensors)


def native_expanded_over_past(
    q_nope: Tensor,
    q_pe: Tensor,
    past: tuple[Tensor, Tensor],
    new: tuple[Tensor, Tensor],
    kv_b: Tensor,
    scale: float,
    tile: int | None = None,
) -> Tensor:
    """`expanded_over_past` of q_nope [Q, H, d_n], q_pe [Q, H, d_r] with past = (n [P, d_c],
    k_pe [P, d_r]) and new = the chunk's own (n [Q, d_c], k_pe [Q, d_r]), given apart (no
    copy of the whole past is made). Returns [Q, H, d_v]."""
    heads, d_n = q_nope.shape[1], q_nope.shape[2]

    def keys(n: Tensor, k_pe: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        kv = F.linear(n, kv_b).view(n.shape[0], heads, -1)
        k_nope, v = kv.split([d_n, kv.shape[-1] - d_n], dim=-1)
        return k_nope, k_pe, v

    width = kv_b.shape[0] + d_n + q_pe.shape[-1] + (kv_b.shape[0] // heads - d_n)
    step = tile or max(MIN_TILE, NATIVE_TILE_ELEMENTS // width)
    return _merged(q_nope, q_pe, past, new, keys, scale, step)


def native_absorbed_over_past(
    q_nope: Tensor,
    q_pe: Tensor,
    past: tuple[Tensor, Tensor],
    new: tuple[Tensor, Tensor],
    kv_b: Tensor,
    scale: float,
    tile: int | None = None,
) -> Tensor:
    """`native_expanded_over_past` in the latent space (`absorbed_over_past`): the keys and
    values are the latents, shared by the heads."""
    heads, d_n = q_nope.shape[1], q_nope.shape[2]
    w = kv_b.view(heads, -1, kv_b.shape[-1])
    w_uk, w_uv = w[:, :d_n], w[:, d_n:]
    q_lat = torch.einsum("qhn,hnc->qhc", q_nope, w_uk)  # [Q, H, d_c]

    def keys(n: Tensor, k_pe: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return n, k_pe, n

    width = 2 * kv_b.shape[-1] + q_pe.shape[-1]
    step = tile or max(MIN_TILE, NATIVE_TILE_ELEMENTS // width)
    u = _merged(q_lat, q_pe, past, new, keys, scale, step)
    return torch.einsum("qhc,hvc->qhv", u, w_uv)


def _merged(
    q_a: Tensor,
    q_b: Tensor,
    past: tuple[Tensor, Tensor],
    new: tuple[Tensor, Tensor],
    keys: Callable[[Tensor, Tensor], tuple[Tensor, Tensor, Tensor]],
    scale: float,
    step: int,
) -> Tensor:
    """The queries over their own keys (causal), then over the past's in tiles of `step`
    (every key seen), merged by log-sum-exp: out = sum_t e^(lse_t - lse) out_t."""
    out, lse = causal_attention.attention_over_keys(q_a, q_b, *keys(*new), 0, scale)
    p_n, p_k_pe = past
    for lo in range(0, p_n.shape[0], step):
        hi = min(lo + step, p_n.shape[0])
        part, part_lse = causal_attention.attention_over_keys(
            q_a, q_b, *keys(p_n[lo:hi], p_k_pe[lo:hi]), hi - lo, scale
        )
        top = torch.maximum(lse, part_lse)
        mine, theirs = (lse - top).exp_(), (part_lse - top).exp_()
        total = mine + theirs
        out = out.mul_((mine / total)[..., None]).add_(part.mul_((theirs / total)[..., None]))
        lse = top.add_(total.log_())
    return out
