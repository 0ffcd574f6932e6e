"""A W4A16 grouped GEMM in Triton: 16-bit (or fp32) activations times INT4 weights with group
scales (compressed-tensors' pack-quantized, int4_packing.py), the routed experts of Kimi
K2-Thinking / K2.5 / K2.6 multiplied without a dequantized copy of their weights.

For a row s of group e (the rows, groups and gathering of grouped_gemm.py's tile loop, which
this kernel shares with the FP8 one):

    out[s, n] = sum_k  a[r, k] * round_a(q[e, n, k] * s[e, n, k // G])

`a` is the activation [rows, K] in its own dtype (no activation quantization: A16); r =
rows[s], or s. `q` are the group's 4-bit values, read from the int32 words [N, K / 8] as
stored (value k % 8 of word k // 8), and `s` its scales [N, K / G] (G = the checkpoint's
group_size, 32 for Kimi). Each K step (`_int4_group_step`, the loop's `STEP`) unpacks a
BLOCK_K x BLOCK_N tile of the weights and multiplies it by its scales in a's dtype, rounded
once (round_a): bit for bit the weights `dequantize_int4` writes in that dtype, so the product
differs from dequantize-then-GEMM only by the order of its fp32 sums (and the output's one
rounding). The tile's product goes to the tensor cores in a's dtype (fp32 ones in full fp32),
accumulated in fp32.

`int4_grouped_mm_reference` (the weights dequantized by `dequantize_int4`, one fp32 matmul per
group) is the reference the tests hold the kernel to. `compile.py` compiles it ahead of time
for sm_90.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from common.triton_kernels import triton_mode
from common.triton_kernels.grouped_gemm import Operands, check_groups, grouped_reference, launch
from common.triton_kernels.int4_packing import INT4_PACK, dequantize_int4
from common.triton_kernels.triton_mode import check_runnable, wrap

try:  # A CPU deployment without triton imports this module and never launches a kernel.
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    tl = None

# 16-bit tensor-core products (mma from sm_80) as Triton compiles them: no FP8 is involved.
MIN_CAPABILITY = (8, 0)


def unsupported(device: torch.device) -> str | None:
    """Why the kernel cannot run on `device` in this process, or None where it can."""
    return triton_mode.unsupported(device, MIN_CAPABILITY, "16-bit tensor cores")


# Columns per K step: the unpacked tile (BLOCK_K x 128 words, then values) stays in registers
# beside a 64 x 128 fp32 accumulator.
INT4_BLOCK_K = 64
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _int4_group_step(
    acc,
    A,  # [rows_a, K] fp32 / bf16 / fp16
    AScale,  # none: never read
    a_rows,  # [BLOCK_M] int64: A's row of each output row of the tile
    mask_m,
    stride_a,
    stride_as_m,
    stride_as_k,
    W,  # this group's words [N, K / 8] int32
    WScale,  # this group's scales [N, K / G]
    WScaleRows,  # none: never read
    WScaleCols,  # none: never read
    n,  # [BLOCK_N] output columns
    mask_n,
    kb,  # the K step: columns [kb * BLOCK_K, kb * BLOCK_K + BLOCK_K)
    K,
    stride_wn,
    stride_sr,
    stride_sc,
    BLOCK_K: tl.constexpr,
    AS_FP32: tl.constexpr,
    SCALE_GROUP: tl.constexpr,
):
    """acc + one BLOCK_K-column step's product with the weights dequantized in A's dtype."""
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = k < K
    a = tl.load(
        A + a_rows[:, None] * stride_a + k[None, :],
        mask=mask_m[:, None] & mask_k[None, :],
        other=0.0,
    )
    # [BLOCK_K, BLOCK_N], K along the rows: the eight values of a word are its eight rows.
    mask_w = mask_k[:, None] & mask_n[None, :]
    row = n[None, :].to(tl.int64)
    words = tl.load(W + row * stride_wn + (k // 8)[:, None], mask=mask_w, other=0)
    q = ((words >> ((k % 8) * 4)[:, None]) & 0xF) - 8
    scale = tl.load(
        WScale + row * stride_sr + (k // SCALE_GROUP)[:, None] * stride_sc, mask=mask_w, other=0.0
    )
    # As dequantize_int4: the scale in A's dtype, times the exact value, rounded once.
    dtype = A.dtype.element_ty
    if AS_FP32:
        # The interpreter's fp32 -> bf16 cast truncates: both roundings to nearest even on
        # the bits instead, the 16-bit values held in fp32 (exactly); its dot runs in fp32.
        if dtype == tl.bfloat16:
            bits = scale.to(tl.float32).to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            w = q.to(tl.float32) * bits.to(tl.float32, bitcast=True)
            bits = w.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            w = bits.to(tl.float32, bitcast=True)
        else:
            w = (q.to(tl.float32) * scale.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        acc = tl.dot(a.to(tl.float32), w, acc=acc, input_precision="ieee")
    else:
        w = (q.to(tl.float32) * scale.to(dtype).to(tl.float32)).to(dtype)
        if dtype == tl.float32:
            acc = tl.dot(a, w, acc=acc, input_precision="ieee")  # TF32 would drop 13 bits
        else:
            acc = tl.dot(a, w, acc=acc)
    return acc


@functools.cache
def group_step() -> Any:
    """The W4A16 step wrapped in this process's mode."""
    return wrap(_int4_group_step)


def _check(
    a: Tensor, ends: Tensor, packed: Tensor, scale: Tensor, group: int, rows: Tensor | None
) -> None:
    """Shape, dtype and device checks: only what the caller's Python objects already say."""
    if packed.dim() != 3 or packed.dtype != torch.int32 or packed.stride(2) != 1:
        raise ValueError(f"packed must be [E, N, K / 8] int32, got {packed.dtype} {packed.shape}")
    e, n, words = packed.shape
    k = words * INT4_PACK
    if (
        group <= 0
        or k % group
        or scale.shape != (e, n, k // group)
        or not scale.is_floating_point()
    ):
        raise ValueError(f"scale must be [{e}, {n}, {k} / {group}] float, got {scale.shape}")
    if a.dim() != 2 or a.dtype not in ACTIVATION_DTYPES or a.shape[1] != k or a.stride(1) != 1:
        raise ValueError(f"a must be [rows, {k}] fp32 / bf16 / fp16, got {a.dtype} {a.shape}")
    check_groups(ends, e, rows, [a, packed, scale])


def int4_grouped_mm(
    a: Tensor,
    ends: Tensor,
    packed: Tensor,
    scale: Tensor,
    group: int,
    out_dtype: torch.dtype,
    rows: Tensor | None = None,
) -> Tensor:
    """out [S, N] in `out_dtype`: row s of group e is A's row `rows[s]` (s without `rows`)
    times group e's INT4 weights (`packed` [E, N, K / 8] int32 words, `scale` [E, N, K /
    group]; the module docstring's sum). S = len(rows), else A's rows. `ends` [E] int32 are
    the groups' end rows, ascending; rows past ends[-1] are left unwritten. Never waits for the
    device; runs on CUDA tensors, or CPU tensors under TRITON_INTERPRET=1."""
    _check(a, ends, packed, scale, group, rows)
    check_runnable(a.device, "the Triton W4A16 grouped GEMM")
    ops = Operands(a, a, packed, scale, ends, ends)  # no activation scales, no scale maps
    _, n, words = packed.shape
    return launch(
        group_step(), ops, ends, rows, n, words * INT4_PACK, out_dtype, INT4_BLOCK_K, group
    )


def int4_grouped_mm_reference(
    a: Tensor,
    ends: Tensor,
    packed: Tensor,
    scale: Tensor,
    group: int,
    out_dtype: torch.dtype,
    rows: Tensor | None = None,
) -> Tensor:
    """`int4_grouped_mm` in plain torch: the weights dequantized in a's dtype
    (`dequantize_int4`), then a and they in fp32, one matmul per group; rows past the last
    group are zeros."""
    _check(a, ends, packed, scale, group, rows)
    e, n, words = packed.shape
    weights = torch.empty(e, n, words * INT4_PACK, dtype=a.dtype, device=a.device)
    dequantize_int4(packed, scale, group, weights)
    return grouped_reference(a.float(), weights.float(), ends, out_dtype, rows)
