"""A grouped GEMM over block-scaled FP8 weights in Triton (DeepSeek's recipe): the routed
experts multiplied without a dequantized copy of their weights.

The output's rows are sorted by group (an expert, or one group for a dense linear): group e
is rows [ends[e-1], ends[e]) (ends[-1] = 0). For a row s of group e:

    out[s, n] = sum_kb  sa[r, kb] * sw[e, rb(n), cb(kb)] * sum_{k in kb} a[r, k] * w[e, n, k]

`a` is the activation as e4m3 values with one fp32 scale `sa` per row and 128-column group
kb (`quantize_groups`, common/model/fp8_gemm.py); r = rows[s], its row for output row s (a
routed slot's token: a token is quantized once, however many of its slots run here), or s.
`w` is the group's e4m3 values [N, K] as stored and `sw` its fp32 block scales, the block of
row n being scale row rb(n) and that of group kb scale column cb(kb) (`BlockFp8`,
fp8_blocks.py: any row blocks, slices and runs; column blocks of 128 x m that a slice's
groups do not straddle).
The products of e4m3 values are exact in fp32; each 128-column block's sum is scaled and
added to an fp32 accumulator (the promotion every 128 columns of DeepGEMM), and the result
is rounded once to the output's dtype. Rows past the last group are not written.

One program per (group, N tile, M split) walks its group's rows in BLOCK_M tiles: a group
with no rows (most experts of a decode step) costs two loads and reads no weight, and the
launch never reads the groups' sizes on the host (a CUDA graph captures it).

The tile loop (`_grouped_gemm_kernel`: the program's group and rows, the K loop, the store)
is apart from the weight format, one K step's loads and product (`_fp8_block_step`, given to
the loop as its constexpr `STEP`). Another format (W4A16: int4 values with group scales) is
another step of the same signature over its own tensors: the loop is shared.

`fp8_grouped_mm_reference` (everything dequantized to fp32, one matmul per group) is the
reference the tests hold the kernel to. `compile.py` compiles it ahead of time for sm_90.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from common.triton_kernels.fp8_blocks import GROUP, BlockFp8
from common.triton_kernels.triton_mode import check_runnable, wrap

try:  # A CPU deployment without triton imports this module and never launches a kernel.
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    tl = None

BLOCK_N = 128  # output columns per program: one 128-row weight block
MAX_M_SPLITS = 64  # bounds the grid's third dimension
NUM_STAGES = 3  # pipelined K steps: 3 x (BLOCK_N x 128 weight + BLOCK_M x 128 activation) bytes
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fp8_block_step(
    acc,
    A,  # [rows_a, K] e4m3
    AScale,  # [rows_a, ceil(K / 128)] fp32
    a_rows,  # [BLOCK_M] int64: A's row of each output row of the tile
    mask_m,
    stride_a,
    stride_as_m,
    stride_as_k,
    W,  # this group's values [N, K] e4m3
    WScale,  # this group's scales [SR, SC] fp32
    WScaleRows,  # [N] int32
    WScaleCols,  # [ceil(K / 128)] int32
    n,  # [BLOCK_N] output columns
    mask_n,
    kb,  # the K step: columns [kb * 128, kb * 128 + 128)
    K,
    stride_wn,
    stride_sr,
    stride_sc,
    BLOCK_K: tl.constexpr,
    FP8_AS_FP32: tl.constexpr,
):
    """acc + one 128-column block's product, scaled by both operands' scales."""
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = k < K
    a = tl.load(
        A + a_rows[:, None] * stride_a + k[None, :],
        mask=mask_m[:, None] & mask_k[None, :],
        other=0.0,
    )
    # [BLOCK_K, BLOCK_N] with K contiguous: the K-major operand FP8 tensor cores take.
    w = tl.load(
        W + n[None, :].to(tl.int64) * stride_wn + k[:, None],
        mask=mask_k[:, None] & mask_n[None, :],
        other=0.0,
    )
    a_scale = tl.load(AScale + a_rows * stride_as_m + kb * stride_as_k, mask=mask_m, other=0.0)
    w_row = tl.load(WScaleRows + n, mask=mask_n, other=0)
    w_scale = tl.load(
        WScale + w_row * stride_sr + tl.load(WScaleCols + kb) * stride_sc, mask=mask_n, other=0.0
    )
    if FP8_AS_FP32:
        # The interpreter gets fp32 copies of the e4m3 values: exact, as are their products.
        part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        part = tl.dot(a, w)
    return acc + part * a_scale[:, None] * w_scale[None, :]


def _grouped_gemm_kernel(
    A,
    AScale,
    Rows,  # [S] int32: A's row of each output row (read where GATHER)
    W,  # [E, N, K]
    WScale,  # [E, SR, SC]
    WScaleRows,
    WScaleCols,
    Ends,  # [E] int32: each group's end row
    Out,  # [S, N]
    N,
    K,
    stride_a,
    stride_as_m,
    stride_as_k,
    stride_we,
    stride_wn,
    stride_se,
    stride_sr,
    stride_sc,
    stride_out,
    GATHER: tl.constexpr,
    STEP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP8_AS_FP32: tl.constexpr,
):
    e = tl.program_id(0)
    split = tl.program_id(2)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = n < N
    start = tl.load(Ends + e - 1, mask=e > 0, other=0)
    end = tl.load(Ends + e)
    # int64 before the group stride: E x N x K passes 2^31 for a rank's experts.
    w_group = W + e.to(tl.int64) * stride_we
    s_group = WScale + e.to(tl.int64) * stride_se
    for m0 in range(start + split * BLOCK_M, end, tl.num_programs(2) * BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        mask_m = rows < end
        if GATHER:
            a_rows = tl.load(Rows + rows, mask=mask_m, other=0).to(tl.int64)
        else:
            a_rows = rows.to(tl.int64)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            acc = STEP(
                acc,
                A,
                AScale,
                a_rows,
                mask_m,
                stride_a,
                stride_as_m,
                stride_as_k,
                w_group,
                s_group,
                WScaleRows,
                WScaleCols,
                n,
                mask_n,
                kb,
                K,
                stride_wn,
                stride_sr,
                stride_sc,
                BLOCK_K,
                FP8_AS_FP32,
            )
        out = Out + rows.to(tl.int64)[:, None] * stride_out + n[None, :]
        tl.store(out, acc.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@functools.cache
def kernels() -> tuple[Any, Any]:
    """(the tile loop, the FP8 block step) wrapped in this process's mode."""
    # N and K are the same for every call of a layer; the strides follow them.
    return wrap(_grouped_gemm_kernel), wrap(_fp8_block_step)


@dataclass(frozen=True)
class Tiles:
    """Rows per tile, programs per (group, N tile) and warps, from the shapes alone (Python
    ints, so choosing never waits for the device)."""

    block_m: int
    m_splits: int
    num_warps: int


def choose_tiles(rows: int, groups: int) -> Tiles:
    """BLOCK_M: the average group's rows rounded up to a power of two in [16, 64] (tl.dot
    needs 16; 64 fills Hopper's wgmma, whose 64 x 128 fp32 product and accumulator take two
    warpgroups without spilling); one program per average group's tiles."""
    per_group = math.ceil(rows / max(groups, 1))
    block_m = min(64, max(16, 1 << (per_group - 1).bit_length()))
    splits = max(1, min(MAX_M_SPLITS, math.ceil(per_group / block_m)))
    return Tiles(block_m, splits, 8 if block_m == 64 else 4)


def _check(a: Tensor, a_scale: Tensor, ends: Tensor, w: BlockFp8, rows: Tensor | None) -> None:
    """Shape, dtype and device checks: only what the caller's Python objects already say."""
    k = w.values.shape[2]
    if a.dim() != 2 or a.dtype != torch.float8_e4m3fn or a.shape[1] != k or a.stride(1) != 1:
        raise ValueError(f"a must be [rows, {k}] float8_e4m3fn, got {a.dtype} {tuple(a.shape)}")
    if a_scale.shape != (a.shape[0], math.ceil(k / GROUP)) or a_scale.dtype != torch.float32:
        raise ValueError(f"a_scale must be [{a.shape[0]}, {math.ceil(k / GROUP)}] float32")
    if ends.shape != (w.values.shape[0],) or ends.dtype != torch.int32:
        raise ValueError(f"ends must be [{w.values.shape[0]}] int32, got {ends.dtype}")
    if rows is not None and (rows.dim() != 1 or rows.dtype != torch.int32):
        raise ValueError(f"rows must be [S] int32, got {rows.dtype} {tuple(rows.shape)}")
    tensors = [a, a_scale, ends, w.values, w.scale, w.scale_rows, w.scale_cols]
    devices = {t.device for t in [*tensors, *([] if rows is None else [rows])]}
    if len(devices) != 1:
        raise ValueError(f"tensors on different devices: {sorted(map(str, devices))}")


def fp8_grouped_mm(
    a: Tensor,
    a_scale: Tensor,
    ends: Tensor,
    w: BlockFp8,
    out_dtype: torch.dtype,
    rows: Tensor | None = None,
) -> Tensor:
    """out [S, N] in `out_dtype`: row s of group e is A's row `rows[s]` (s without `rows`)
    times group e's weights (the module docstring's sum). S = len(rows), else A's rows.
    `ends` [E] int32 are the groups' end rows, ascending (the caller's contract, as for every
    grouped GEMM); rows past ends[-1] are left unwritten. Never waits for the device; runs on
    CUDA tensors, or CPU tensors under TRITON_INTERPRET=1."""
    _check(a, a_scale, ends, w, rows)
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be fp32 / bf16 / fp16, got {out_dtype}")
    check_runnable(a.device, "the Triton FP8 grouped GEMM")
    groups, n, k = w.values.shape
    s = a.shape[0] if rows is None else rows.shape[0]
    out = torch.empty(s, n, dtype=out_dtype, device=a.device)
    if s == 0 or groups == 0 or n == 0:
        return out
    tiles = choose_tiles(s, groups)
    loop, step = kernels()
    with torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext():
        loop[(groups, math.ceil(n / BLOCK_N), tiles.m_splits)](
            a,
            a_scale,
            ends if rows is None else rows,  # never read without GATHER
            w.values,
            w.scale,
            w.scale_rows,
            w.scale_cols,
            ends,
            out,
            n,
            k,
            a.stride(0),
            a_scale.stride(0),
            a_scale.stride(1),
            w.values.stride(0),
            w.values.stride(1),
            w.scale.stride(0),
            w.scale.stride(1),
            w.scale.stride(2),
            out.stride(0),
            GATHER=rows is not None,
            STEP=step,
            BLOCK_M=tiles.block_m,
            BLOCK_N=BLOCK_N,
            BLOCK_K=GROUP,
            FP8_AS_FP32=not a.is_cuda,
            num_warps=tiles.num_warps,
            num_stages=NUM_STAGES,
        )
    return out


def dequantized(w: BlockFp8) -> Tensor:
    """The weights [E, N, K] in fp32: each value times its block's scale."""
    k = w.values.shape[2]
    scales = w.scale[:, w.scale_rows.long()][:, :, w.scale_cols.long()]  # [E, N, groups]
    return w.values.float() * scales.repeat_interleave(GROUP, dim=-1)[..., :k]


def fp8_grouped_mm_reference(
    a: Tensor,
    a_scale: Tensor,
    ends: Tensor,
    w: BlockFp8,
    out_dtype: torch.dtype,
    rows: Tensor | None = None,
) -> Tensor:
    """`fp8_grouped_mm` in plain torch: both operands dequantized to fp32, one matmul per
    group; rows past the last group are zeros."""
    _check(a, a_scale, ends, w, rows)
    k = a.shape[1]
    x = a.float() * a_scale.repeat_interleave(GROUP, dim=1)[:, :k]
    if rows is not None:
        x = x[rows.long()]
    weights = dequantized(w)
    out = torch.zeros(x.shape[0], weights.shape[1], device=a.device)
    bounds = [0, *ends.tolist()]
    for e in range(weights.shape[0]):
        out[bounds[e] : bounds[e + 1]] = x[bounds[e] : bounds[e + 1]] @ weights[e].t()
    return out.to(out_dtype)
