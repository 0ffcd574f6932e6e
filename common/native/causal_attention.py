"""The native causal prefill attention kernel (causal_attention.cpp) behind a checked call.

`causal_attention` computes what `SdpaPrefillAttention.causal` computes (torch SDPA, the
reference) for packed sequences: fp32 CPU only. `available()` says whether it can run here;
`NativePrefillAttention` (common/model/prefill_attention.py) keeps SDPA for everything else.
`attention_over_keys` is the same kernel for queries that start after their keys do (a chunk
over its past), with each row's log-sum-exp.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from common.native.library import NativeUnavailable, load_optional

_Tensors = ctypes.c_void_p * 10
_Dims = ctypes.c_int64 * 18
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
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"causal_attention: q, k [T, H, d_qk] and v [T, H, d_v] expected, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    empty = q[..., :0]
    return _attend(q, empty, k, empty, v, _Sequences(cu_seqlens), scale, threads)[0]


def causal_attention_mla(
    q_nope: Tensor,
    q_pe: Tensor,
    k_nope: Tensor,
    k_pe: Tensor,
    v: Tensor,
    cu_seqlens: Sequence[int],
    scale: float,
    threads: int | None = None,
) -> Tensor:
    """`causal_attention` of q = [q_nope | q_pe] and k = [k_nope | k_pe] without building them:
    q_nope, k_nope [T, H, d_n], q_pe [T, H, d_r], k_pe [T, d_r] (shared by the heads, MLA's
    decoupled RoPE key), v [T, H, d_v]. Any strides with a contiguous last dimension (k_nope
    and v may be views into the up-projected [T, H, d_n + d_v])."""
    dims_ok = (q_nope.dim(), q_pe.dim(), k_pe.dim(), v.dim()) == (3, 3, 2, 3)
    total, heads = q_nope.shape[:2] if dims_ok else (0, 0)
    if not (
        dims_ok
        and k_nope.shape == q_nope.shape
        and q_pe.shape[:2] == v.shape[:2] == (total, heads)
        and k_pe.shape == (total, q_pe.shape[2])
    ):
        raise ValueError(
            "causal_attention_mla: q_nope, k_nope [T, H, d_n], q_pe [T, H, d_r], k_pe [T, d_r], "
            f"v [T, H, d_v] expected, got {tuple(q_nope.shape)}, {tuple(q_pe.shape)}, "
            f"{tuple(k_nope.shape)}, {tuple(k_pe.shape)}, {tuple(v.shape)}"
        )
    k_b = k_pe[:, None].expand(-1, heads, -1)
    return _attend(q_nope, q_pe, k_nope, k_b, v, _Sequences(cu_seqlens), scale, threads)[0]


def attention_over_keys(
    q_a: Tensor,
    q_b: Tensor,
    k_a: Tensor,
    k_b: Tensor,
    v: Tensor,
    offset: int,
    scale: float,
    threads: int | None = None,
) -> tuple[Tensor, Tensor]:
    """One sequence's Q queries q = [q_a | q_b] ([Q, H, *]) over K keys k = [k_a | k_b] and
    values v ([K, H, *], or [K, *] shared by the heads), query i seeing keys 0..i + offset
    (offset >= K - 1: all of them). Returns the output [Q, H, d_v] and each row's log-sum-exp
    of its scaled scores [Q, H], by which separate calls over disjoint keys merge."""
    heads = q_a.shape[1]
    keys = [t if t.dim() == 3 else t[:, None].expand(-1, heads, -1) for t in (k_a, k_b, v)]
    total, count = q_a.shape[0], keys[0].shape[0]
    if not (
        q_a.dim() == q_b.dim() == 3
        and q_b.shape[:2] == q_a.shape[:2]
        and all(t.dim() == 3 and t.shape[:2] == (count, heads) for t in keys)
        and k_a.shape[-1] == q_a.shape[-1]
        and k_b.shape[-1] == q_b.shape[-1]
        and offset >= 0
        and (count > 0 or total == 0)
    ):
        raise ValueError(
            "attention_over_keys: q_a, q_b [Q, H, *]; k_a, k_b, v [K, H, *] or [K, *] of the "
            f"queries' widths, K > 0, offset >= 0; got {tuple(q_a.shape)}, {tuple(q_b.shape)}, "
            f"{[tuple(t.shape) for t in (k_a, k_b, v)]}, offset {offset}"
        )
    sequences = _Sequences([0, total], [0, count], [offset])
    out, lse = _attend(q_a, q_b, *keys, sequences, scale, threads, lse=True)
    assert lse is not None
    return out, lse


class _Sequences:
    """Packed sequences: queries qcu[b]:qcu[b+1] over keys kcu[b]:kcu[b+1] with offsets[b]
    (the same rows and offset 0: causal self-attention)."""

    def __init__(
        self,
        qcu: Sequence[int],
        kcu: Sequence[int] | None = None,
        offsets: Sequence[int] | None = None,
    ) -> None:
        self.qcu = torch.tensor(list(qcu), dtype=torch.int64)
        self.kcu = self.qcu if kcu is None else torch.tensor(list(kcu), dtype=torch.int64)
        count = max(0, self.qcu.numel() - 1)
        self.offsets = torch.tensor(list(offsets or [0] * count), dtype=torch.int64)


def _attend(
    qa: Tensor,
    qb: Tensor,
    ka: Tensor,
    kb: Tensor,
    v: Tensor,
    seqs: _Sequences,
    scale: float,
    threads: int | None,
    *,
    lse: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The kernel over q = [qa | qb], k = [ka | kb] (all [T, H, *], kb may have head stride 0)
    -> the output and, if asked, each row's log-sum-exp."""
    lib = _library()
    if lib is None:
        raise NativeUnavailable("the native prefill attention kernel is not available")
    if not supports(qa, qb, ka, kb, v):
        raise ValueError("causal_attention takes fp32 CPU tensors outside autograd")
    operands = [
        t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous() for t in (qa, qb, ka, kb, v)
    ]
    total, heads, _ = qa.shape
    keys = ka.shape[0]
    qcu, kcu = seqs.qcu, seqs.kcu
    for cu, end in ((qcu, total), (kcu, keys)):
        if cu.numel() < 1 or cu[0] != 0 or cu[-1] != end or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must rise from 0 to {end}, got {cu.tolist()}")
    out = torch.empty(total, heads, v.shape[-1])
    row_lse = torch.empty(total, heads) if lse else None
    strides = [s for t in operands for s in t.stride()[:2]]
    status = lib.tpla_causal_attention(
        _Tensors(
            *(t.data_ptr() for t in operands),
            out.data_ptr(),
            row_lse.data_ptr() if row_lse is not None else None,
            qcu.data_ptr(),
            kcu.data_ptr(),
            seqs.offsets.data_ptr(),
        ),
        _Dims(
            qcu.numel() - 1,
            total,
            keys,
            heads,
            qa.shape[-1],
            qb.shape[-1],
            v.shape[-1],
            threads or torch.get_num_threads(),
            *strides,
        ),
        _Scalars(scale),
    )
    if status:  # checked above too: the kernel re-checks what it indexes by
        raise ValueError(
            f"causal_attention: bad sequences {qcu.tolist()} / {kcu.tolist()} "
            f"offsets {seqs.offsets.tolist()}"
        )
    return out, row_lse
