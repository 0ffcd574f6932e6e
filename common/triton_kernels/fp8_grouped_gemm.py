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

The tile loop (the program's group and rows, the K loop, the store) is grouped_gemm.py's,
shared with the W4A16 kernel (int4_grouped_gemm.py); this module is its FP8 K step
(`_fp8_block_step`, given to the loop as its constexpr `STEP`) and the host wrapper.

`fp8_grouped_mm_reference` (everything dequantized to fp32, one matmul per group) is the
reference the tests hold the kernel to. `compile.py` compiles it ahead of time for sm_90.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor

from common.triton_kernels.fp8_blocks import GROUP, BlockFp8
from common.triton_kernels.grouped_gemm import Operands, check_groups, grouped_reference, launch
from common.triton_kernels.triton_mode import check_runnable, wrap

try:  # A CPU deployment without triton imports this module and never launches a kernel.
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    tl = None


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
    AS_FP32: tl.constexpr,
    SCALE_GROUP: tl.constexpr,  # W4A16's; the scale columns here are WScaleCols'
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
    if AS_FP32:
        # The interpreter gets fp32 copies of the e4m3 values: exact, as are their products.
        part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        part = tl.dot(a, w)
    return acc + part * a_scale[:, None] * w_scale[None, :]


@functools.cache
def block_step() -> Any:
    """The FP8 block step wrapped in this process's mode."""
    return wrap(_fp8_block_step)


def _check(a: Tensor, a_scale: Tensor, ends: Tensor, w: BlockFp8, rows: Tensor | None) -> None:
    """Shape, dtype and device checks: only what the caller's Python objects already say."""
    k = w.values.shape[2]
    if a.dim() != 2 or a.dtype != torch.float8_e4m3fn or a.shape[1] != k or a.stride(1) != 1:
        raise ValueError(f"a must be [rows, {k}] float8_e4m3fn, got {a.dtype} {tuple(a.shape)}")
    if a_scale.shape != (a.shape[0], math.ceil(k / GROUP)) or a_scale.dtype != torch.float32:
        raise ValueError(f"a_scale must be [{a.shape[0]}, {math.ceil(k / GROUP)}] float32")
    tensors = [a, a_scale, w.values, w.scale, w.scale_rows, w.scale_cols]
    check_groups(ends, w.values.shape[0], rows, tensors)


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
    check_runnable(a.device, "the Triton FP8 grouped GEMM")
    ops = Operands(a, a_scale, w.values, w.scale, w.scale_rows, w.scale_cols)
    _, n, k = w.values.shape
    return launch(block_step(), ops, ends, rows, n, k, out_dtype, GROUP)


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
    return grouped_reference(x, dequantized(w), ends, out_dtype, rows)
