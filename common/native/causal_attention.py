"""The native causal prefill attention kernel (causal_attention.cpp) behind a checked call.

`causal_attention` computes what `SdpaBackend.causal` computes (torch SDPA, the reference)
for packed sequences: fp32 CPU only. `available()` says whether it can run here;
`NativeBackend` (common/model/attn_backend.py) keeps SDPA for everything else.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from common.native.library import NativeUnavailable, load_optional

_Tensors = ctypes.c_void_p * 5
_Dims = ctypes.c_int64 * 6
_Scalars = ctypes.c_float * 1


@functools.cache
def _library() -> ctypes.CDLL | None:
    return load_optional(
        "causal_attention",
        {"tpla_causal_attention": [_Tensors, _Dims, _Scalars]},
        "native prefill attention kernel",
    )


def available() -> bool:
    """True if the kernel is built (building it now if needed) and loads on this machine."""
    return _library() is not None


def supports(*tensors: Tensor) -> bool:
    """The kernel's domain: fp32 CPU tensors, outside autograd."""
    return all(t.is_cpu and t.dtype == torch.float32 for t in tensors) and not (
        torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    )


def causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Sequence[int],
    scale: float,
    threads: int | None = None,
) -> Tensor:
    """q, k [T, H, d_qk], v [T, H, d_v] over sequences cu_seqlens[b]:cu_seqlens[b+1] ->
    [T, H, d_v]: each token attends to itself and the earlier tokens of its sequence.
    `threads` (split over heads) defaults to torch's intra-op threads."""
    lib = _library()
    if lib is None:
        raise NativeUnavailable("the native prefill attention kernel is not available")
    if not supports(q, k, v):
        raise ValueError("causal_attention takes fp32 CPU tensors outside autograd")
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"causal_attention: q, k [T, H, d_qk] and v [T, H, d_v] expected, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    total, heads, d_qk = q.shape
    cu = torch.tensor(list(cu_seqlens), dtype=torch.int64)
    if cu.numel() < 1 or cu[0] != 0 or cu[-1] != total or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to {total}, got {list(cu_seqlens)}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty(total, heads, v.shape[-1])
    status = lib.tpla_causal_attention(
        _Tensors(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), cu.data_ptr()),
        _Dims(cu.numel() - 1, total, heads, d_qk, v.shape[-1], threads or torch.get_num_threads()),
        _Scalars(scale),
    )
    if status:  # checked above too: the kernel re-checks what it indexes by
        raise ValueError(f"causal_attention: bad cu_seqlens {list(cu_seqlens)}")
    return out
