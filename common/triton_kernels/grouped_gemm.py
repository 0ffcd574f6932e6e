"""The tile loop every Triton grouped GEMM of this package shares, apart from the weight
format: which group and rows a program takes, its K loop, its store.

The output's rows are sorted by group (an expert, or one group for a dense linear): group e
is rows [ends[e-1], ends[e]) (ends[-1] = 0). Row s of group e is activation row r = rows[s]
(a routed slot's token: the loop gathers it, so a token is read once however many of its
slots run here), or s without `rows`, times group e's weights [N, K]. Rows past the last
group are not written.

One program per (group, N tile, M split) walks its group's rows in BLOCK_M tiles: a group
with no rows (most experts of a decode step) costs two loads and reads no weight, and the
launch never reads the groups' sizes on the host (a CUDA graph captures it).

One K step's loads and product is the format's (`STEP`, a constexpr): the FP8 block step
(fp8_grouped_gemm.py) and the W4A16 step (int4_grouped_gemm.py) take the same arguments,
each reading the ones its format has (the other operands are passed and never read).
`grouped_reference` is the one matmul per group both formats' references end in.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from common.triton_kernels.triton_mode import wrap

try:  # A CPU deployment without triton imports this module and never launches a kernel.
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    tl = None

BLOCK_N = 128  # output columns per program: one 128-row FP8 weight block
MAX_M_SPLITS = 64  # bounds the grid's third dimension
NUM_STAGES = 3  # pipelined K steps
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_gemm_kernel(
    A,
    AScale,
    Rows,  # [S] int32: A's row of each output row (read where GATHER)
    W,  # [E, N, ...] the weights as the format stores them
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
    AS_FP32: tl.constexpr,
    SCALE_GROUP: tl.constexpr,
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
                AS_FP32,
                SCALE_GROUP,
            )
        out = Out + rows.to(tl.int64)[:, None] * stride_out + n[None, :]
        tl.store(out, acc.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@functools.cache
def tile_loop() -> Any:
    """The tile loop wrapped in this process's mode."""
    # N and K are the same for every call of a layer; the strides follow them.
    return wrap(_grouped_gemm_kernel)


@dataclass(frozen=True)
class Tiles:
    """Rows per tile, programs per (group, N tile) and warps, from the shapes alone (Python
    ints, so choosing never waits for the device)."""

    block_m: int
    m_splits: int
    num_warps: int


def choose_tiles(rows: int, groups: int, max_block_m: int = 64) -> Tiles:
    """BLOCK_M: the average group's rows rounded up to a power of two in [16, max_block_m]
    (tl.dot needs 16; 64 fills Hopper's wgmma, whose 64 x 128 fp32 product and accumulator
    take two warpgroups without spilling); one program per average group's tiles."""
    per_group = math.ceil(rows / max(groups, 1))
    block_m = min(max_block_m, max(16, 1 << (per_group - 1).bit_length()))
    splits = max(1, min(MAX_M_SPLITS, math.ceil(per_group / block_m)))
    return Tiles(block_m, splits, 8 if block_m == 64 else 4)


def max_block_m(device: torch.device) -> int:
    """The largest row tile on `device`: 64 where wgmma runs it (sm_90+, and the CPU's
    interpreter, which has no registers to spill); 32 on the GPUs before, whose mma.sync
    tiles of 64 rows at 8 warps spill registers (ptxas: 396 bytes at sm_80)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        return 32
    return 64


def check_groups(ends: Tensor, groups: int, rows: Tensor | None, tensors: list[Tensor]) -> None:
    """`ends` and `rows` as every grouped GEMM takes them, and every tensor on one device."""
    if ends.shape != (groups,) or ends.dtype != torch.int32:
        raise ValueError(f"ends must be [{groups}] int32, got {ends.dtype}")
    if rows is not None and (rows.dim() != 1 or rows.dtype != torch.int32):
        raise ValueError(f"rows must be [S] int32, got {rows.dtype} {tuple(rows.shape)}")
    devices = {t.device for t in [*tensors, ends, *([] if rows is None else [rows])]}
    if len(devices) != 1:
        raise ValueError(f"tensors on different devices: {sorted(map(str, devices))}")


@dataclass(frozen=True)
class Operands:
    """One launch's tensors in the loop's order: `a_scale` [rows, SC], `w` [E, N, ...] and
    `w_scale` [E, SR, SC] by their strides; a format without one passes any tensor of that
    rank in its place (its step never reads it)."""

    a: Tensor
    a_scale: Tensor
    w: Tensor
    w_scale: Tensor
    w_scale_rows: Tensor
    w_scale_cols: Tensor


def launch(
    step: Any,
    ops: Operands,
    ends: Tensor,
    rows: Tensor | None,
    n: int,
    k: int,
    out_dtype: torch.dtype,
    block_k: int,
    scale_group: int = 1,
) -> Tensor:
    """out [S, N] in `out_dtype` of the grouped GEMM whose K step is `step` (the module
    docstring's rows). Never waits for the device."""
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be fp32 / bf16 / fp16, got {out_dtype}")
    a, groups = ops.a, ends.shape[0]
    s = a.shape[0] if rows is None else rows.shape[0]
    out = torch.empty(s, n, dtype=out_dtype, device=a.device)
    if s == 0 or groups == 0 or n == 0:
        return out
    tiles = choose_tiles(s, groups, max_block_m(a.device))
    with torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext():
        tile_loop()[(groups, math.ceil(n / BLOCK_N), tiles.m_splits)](
            a,
            ops.a_scale,
            ends if rows is None else rows,  # never read without GATHER
            ops.w,
            ops.w_scale,
            ops.w_scale_rows,
            ops.w_scale_cols,
            ends,
            out,
            n,
            k,
            a.stride(0),
            ops.a_scale.stride(0),
            ops.a_scale.stride(1),
            ops.w.stride(0),
            ops.w.stride(1),
            ops.w_scale.stride(0),
            ops.w_scale.stride(1),
            ops.w_scale.stride(2),
            out.stride(0),
            GATHER=rows is not None,
            STEP=step,
            BLOCK_M=tiles.block_m,
            BLOCK_N=BLOCK_N,
            BLOCK_K=block_k,
            AS_FP32=not a.is_cuda,
            SCALE_GROUP=scale_group,
            num_warps=tiles.num_warps,
            num_stages=NUM_STAGES,
        )
    return out


def grouped_reference(
    x: Tensor, weights: Tensor, ends: Tensor, out_dtype: torch.dtype, rows: Tensor | None
) -> Tensor:
    """x [R, K] fp32 (row s taken from `rows[s]` where given) times each group's weights
    [E, N, K] fp32, one matmul per group; rows past the last group are zeros."""
    if rows is not None:
        x = x[rows.long()]
    out = torch.zeros(x.shape[0], weights.shape[1], device=x.device)
    bounds = [0, *ends.tolist()]
    for e in range(weights.shape[0]):
        out[bounds[e] : bounds[e + 1]] = x[bounds[e] : bounds[e + 1]] @ weights[e].t()
    return out.to(out_dtype)
