"""The native decode attention kernel (latent_attention.cpp) behind a typed, checked call.

`paged_latent_attention` computes what `fused_slice_attention` computes (reference:
`latent_slice_attention`), reading one layer of a `PagedLatentCache` in place through a
block table. It is fp32 and CPU only; `available()` says whether it can run here, and
callers keep the PyTorch kernel for everything else.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
from torch import Tensor

from common.native.library import NativeUnavailable, load_optional

log = logging.getLogger(__name__)

_ERRORS = {
    1: "a sequence length is < 1 or longer than its block table",
    2: "a block id is outside the cache pool",
}


_Tensors = ctypes.c_void_p * 8
_Dims = ctypes.c_int64 * 10
_Scalars = ctypes.c_float * 2


@functools.cache
def _library() -> ctypes.CDLL | None:
    return load_optional(
        "latent_attention",
        {"tpla_paged_attention": [_Tensors, _Dims, _Scalars]},
        "native attention kernel",
    )


def available() -> bool:
    """True if the kernel is built (building it now if needed) and loads on this machine."""
    return _library() is not None


def supports(*tensors: Tensor) -> bool:
    """The kernel's domain: fp32 CPU tensors."""
    # `is_cpu` rather than `device.type`: building a device object per tensor costs more
    # than the kernel at small shapes.
    return all(t.is_cpu and t.dtype == torch.float32 for t in tensors)


def paged_latent_attention(
    q_nope: Tensor,
    q_pe: Tensor,
    kv: Tensor,
    block_ids: Tensor,
    lengths: Tensor,
    block_size: int,
    w_uk: Tensor,
    w_uv: Tensor,
    scale: float,
    beta: float,
    threads: int | None = None,
) -> Tensor:
    """W_UV^h[:, S_i] u^h_i as [B, h, d_v], as `fused_slice_attention` returns it.

    q_nope [B, h, d_n], q_pe [B, h, d_r]; kv [slots, w + d_r] is one layer of the cache
    (`PagedLatentCache.kv[layer]`); block_ids [B, nb] int64, sequence b's token t at slot
    block_ids[b, t // block_size] * block_size + t % block_size, valid for t < lengths[b].
    w_uk [h, d_n, w], w_uv [h, d_v, w]. `threads` defaults to torch's intra-op threads.
    This runs once per layer per decode step, so the checks are kept to what protects
    memory: dtypes, devices, contiguity and shapes here, lengths and block ids in the kernel.
    """
    lib = _library()
    if lib is None:
        raise NativeUnavailable("the native attention kernel is not available")
    b, h, d_n = q_nope.shape
    d_r = q_pe.shape[-1]
    w = w_uk.shape[-1]
    d_v = w_uv.shape[1]
    tensors = (q_nope, q_pe, kv, w_uk, w_uv)
    if not supports(*tensors) or not all(t.is_contiguous() for t in tensors):
        raise ValueError("paged_latent_attention takes contiguous fp32 CPU tensors")
    if not all(t.dtype == torch.int64 and t.is_cpu for t in (block_ids, lengths)):
        raise ValueError("paged_latent_attention takes int64 CPU block ids and lengths")
    block_ids, lengths = block_ids.contiguous(), lengths.contiguous()
    shapes = (q_pe.shape, kv.shape[1], w_uk.shape, w_uv.shape, lengths.shape, block_ids.shape[0])
    if shapes != ((b, h, d_r), w + d_r, (h, d_n, w), (h, d_v, w), (b,), b) or kv.dim() != 2:
        raise ValueError("paged_latent_attention: inconsistent shapes")
    if kv.shape[0] % block_size:
        raise ValueError("paged_latent_attention: the cache is not whole blocks")
    out = torch.empty(b, h, d_v)
    status = lib.tpla_paged_attention(
        _Tensors(
            q_nope.data_ptr(),
            q_pe.data_ptr(),
            kv.data_ptr(),
            block_ids.data_ptr(),
            lengths.data_ptr(),
            w_uk.data_ptr(),
            w_uv.data_ptr(),
            out.data_ptr(),
        ),
        _Dims(
            b,
            h,
            d_n,
            d_r,
            w,
            d_v,
            block_ids.shape[1],
            block_size,
            kv.shape[0] // block_size,
            threads or torch.get_num_threads(),
        ),
        _Scalars(scale, beta),
    )
    if status:
        raise ValueError(f"paged_latent_attention: {_ERRORS.get(status, status)}")
    return out
