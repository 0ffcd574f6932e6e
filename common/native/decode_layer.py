"""A decode layer's attention inputs and RMSNorm in native calls (decode_layer.cpp).

`AttentionInputs` binds one layer's weights once and then turns the hidden state of B new
tokens into the attention kernel's queries, writing each token's latent and rotated k_pe into
the layer's cache on the way: what `RankAttention.queries`, `RankAttention.new_latent` and
`PagedLatentCache.write` do in ~45 torch ops. `rms_norm` is `RMSNorm.forward`. Both are fp32
CPU only; callers keep the PyTorch path (the reference) for everything else.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from common.native.library import NativeUnavailable, load_optional

_Tensors = ctypes.c_void_p * 14
_Dims = ctypes.c_int64 * 11
_Scalars = ctypes.c_float * 4
_p = ctypes.c_void_p
_i = ctypes.c_int64


@functools.cache
def _library() -> ctypes.CDLL | None:
    return load_optional(
        "decode_layer",
        {
            "tpla_attention_inputs": [_Tensors, _Dims, _Scalars],
            "tpla_rms_norm": [_p, _p, _p, _i, _i, ctypes.c_float],
        },
        "native decode layer inputs",
    )


def available() -> bool:
    """True if the library is built (building it now if needed) and loads here."""
    return _library() is not None


def _fp32(*tensors: Tensor) -> bool:
    return all(t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`RMSNorm.forward` for contiguous fp32 CPU rows x [M, D]."""
    lib = _library()
    if lib is None:
        raise NativeUnavailable("the native decode layer library is not available")
    if x.dim() != 2 or not _fp32(x, weight) or weight.shape != x.shape[1:]:
        raise ValueError("rms_norm takes contiguous fp32 CPU rows [M, D] and a weight [D]")
    y = torch.empty_like(x)
    lib.tpla_rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
    return y


@dataclass(frozen=True)
class LayerWeights:
    """What one rank's layer needs for its attention inputs (fp32, contiguous).

    `kv_latent` holds the latent rows the rank computes: all d_c in exact TPLA (the slice's
    columns start at `latent_offset`), or only its slice in sliced TPLA (offset 0, the rms
    divided by `rms_correction`). `kv_norm` is the gamma of the cached columns only.
    """

    norm: Tensor  # [D] input RMSNorm weight
    eps: float
    q_a: Tensor | None  # [R, D] query low-rank projection, or None
    q_a_norm: Tensor | None  # [R]
    q_a_eps: float
    q_b: Tensor  # [H * (d_n + d_r), R or D]
    kv_latent: Tensor  # [C, D]
    kv_rope: Tensor  # [d_r, D]
    kv_norm: Tensor  # [width]
    kv_eps: float
    latent_offset: int
    rms_correction: float
    heads: int
    d_n: int
    d_r: int
    interleaved: bool


class AttentionInputs:
    """One layer's fused attention inputs; `__call__` runs once per layer per decode step,
    from one thread at a time (the argument arrays are reused between calls).

    Any batch size: the projections run in the shared register tiles, which read each weight
    tile once per call while every row passes (unlike `small_gemm.linear`, no BLAS above 8
    rows). Measured on the demo model, one process: faster than the PyTorch path at batch
    1-16 and level at 32 (27.2-27.4 vs 27.8-28.6 ms a step, best of 300).
    """

    def __init__(self, w: LayerWeights) -> None:
        lib = _library()
        if lib is None:
            raise NativeUnavailable("the native decode layer library is not available")
        weights = [w.norm, w.q_b, w.kv_latent, w.kv_rope, w.kv_norm]
        if w.q_a is not None:
            assert w.q_a_norm is not None
            weights += [w.q_a, w.q_a_norm]
        if not _fp32(*weights):
            raise ValueError("AttentionInputs takes contiguous fp32 CPU weights")
        d = w.norm.shape[0]
        r = 0 if w.q_a is None else w.q_a.shape[0]
        width = w.kv_norm.shape[0]
        c = w.kv_latent.shape[0]
        expected = {
            "q_b": (w.q_b.shape, (w.heads * (w.d_n + w.d_r), r or d)),
            "kv_latent": (w.kv_latent.shape[1:], (d,)),
            "kv_rope": (w.kv_rope.shape, (w.d_r, d)),
        }
        if w.q_a is not None:
            expected["q_a"] = (w.q_a.shape, (r, d))
        for name, (got, want) in expected.items():
            if tuple(got) != tuple(want):
                raise ValueError(f"AttentionInputs: {name} has shape {tuple(got)}, not {want}")
        if w.latent_offset < 0 or w.latent_offset + width > c:
            raise ValueError("AttentionInputs: the cached columns are outside the latent")
        if w.d_r % 2:
            raise ValueError("AttentionInputs: the rope width must be even")
        self._lib = lib
        self._w = w  # keeps the weights alive: their addresses are bound below
        self._width = width
        self._tensors = _Tensors(
            None,
            w.norm.data_ptr(),
            None if w.q_a is None else w.q_a.data_ptr(),
            None if w.q_a_norm is None else w.q_a_norm.data_ptr(),
            w.q_b.data_ptr(),
            w.kv_latent.data_ptr(),
            w.kv_rope.data_ptr(),
            w.kv_norm.data_ptr(),
        )
        # B (0) and the cache's slots (9) are set per call.
        self._dims = _Dims(
            0, d, r, w.heads, w.d_n, w.d_r, c, w.latent_offset, width, 0, w.interleaved
        )
        self._scalars = _Scalars(w.eps, w.q_a_eps, w.kv_eps, w.rms_correction)

    def __call__(
        self, h: Tensor, cos: Tensor, sin: Tensor, cache: Tensor, write_slots: Tensor
    ) -> tuple[Tensor, Tensor]:
        """h [B, D], cos / sin [B, d_r / 2] -> q_nope [B, H, d_n], rotated q_pe [B, H, d_r].

        Writes token b's cached latent columns and rotated k_pe into row write_slots[b] of
        `cache` [slots, width + d_r] (one layer of `PagedLatentCache.kv`); -1 writes nothing.
        """
        w, b = self._w, h.shape[0]
        half = w.d_r // 2
        if not (
            _fp32(h, cos, sin, cache)
            and h.shape == (b, w.norm.shape[0])
            and cos.shape == (b, half)
            and sin.shape == (b, half)
            and cache.dim() == 2
            and cache.shape[1] == self._width + w.d_r
            and write_slots.dtype == torch.int64
            and write_slots.shape == (b,)
            and write_slots.is_contiguous()
        ):
            raise ValueError("AttentionInputs: inconsistent inputs (fp32 CPU, shapes)")
        q_nope = torch.empty(b, w.heads, w.d_n)
        q_pe = torch.empty(b, w.heads, w.d_r)
        t = self._tensors
        t[0], t[8], t[9], t[10] = h.data_ptr(), cos.data_ptr(), sin.data_ptr(), cache.data_ptr()
        t[11], t[12], t[13] = write_slots.data_ptr(), q_nope.data_ptr(), q_pe.data_ptr()
        self._dims[0], self._dims[9] = b, cache.shape[0]
        if self._lib.tpla_attention_inputs(t, self._dims, self._scalars):
            raise ValueError("AttentionInputs: a write slot is outside the cache")
        return q_nope, q_pe
