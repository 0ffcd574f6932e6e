"""Paged absorbed-MLA / TPLA decode attention over one rank's latent slice, in Triton.

One query per sequence attends over its cached rows `[n (W) | k_pe (R)]`, read in place
through the block table (no gathered copy):

    score_t = q . kv[slot_t]                     (scale and 1/beta already folded into q)
    u       = sum_t softmax(score)_t kv[slot_t, :W],    lse = logsumexp_t(score_t)

Two stages, as in flash-decoding and SGLang's Triton MLA decode kernel:
  1. grid (batch, head tiles, splits): each program walks its split of one sequence's tokens
     with an online softmax and writes the split's normalized partial (acc / sum, lse) to a
     workspace. The n part and the rope part are separate tiles with separate `tl.dot`s.
  2. grid (batch, heads): merges the splits with log-sum-exp into u and lse.
A split (or a sequence) with no valid token writes lse = -inf and weighs nothing in the merge.

`paged_decode_attention_reference` (gather + einsum, fp32) is the reference the tests hold
the kernel to. The kernels are plain functions, wrapped when first launched in the mode that
triton was imported in (common/triton_kernels/triton_mode.py): compiled for CUDA tensors, or
run by Triton's interpreter on CPU tensors when TRITON_INTERPRET=1 was set before triton's
first import (the tests' way).
`compile.py` compiles them ahead of time for sm_80 / sm_90 without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from common.kv.slots import token_slots
from common.triton_kernels.triton_mode import check_runnable, wrap

try:  # A CPU deployment without triton imports this module and never launches a kernel.
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    tl = None

# A split shorter than this saves less than its merge costs (flash-decoding practice).
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32  # bounds the workspace [B, H, splits, W] and stage 2's loop
# Register budget of one program's fp32 accumulator, BLOCK_H * BLOCK_W elements: SGLang's
# tile (16 heads x 512 latent columns). A narrower TPLA slice gets more heads per tile, so
# the cache is read by fewer head tiles.
ACC_ELEMENTS = 16 * 512
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MERGE_WARPS = 4  # stage 2: one program per (sequence, head), a short loop over splits
MERGE_STAGES = 1
MAX_GRID_Z = 65535  # CUDA's limit on the third grid dimension (the splits)


@dataclass(frozen=True)
class Tiles:
    """Compile-time tile sizes and launch options of stage 1 for one shape and dtype."""

    block_h: int  # heads per program (padded and masked: tl.dot needs M >= 16)
    block_n: int  # tokens per loop step
    block_w: int  # latent columns, next power of two >= W
    block_r: int  # rope columns, next power of two >= R
    num_warps: int = 4
    num_stages: int = 2


def choose_tiles(heads: int, width: int, rope_width: int, dtype: torch.dtype) -> Tiles:
    """Tiles for `heads` query heads over W = `width` latent and R = `rope_width` rope columns."""
    block_w = max(16, 1 << (width - 1).bit_length())
    block_r = max(16, 1 << (rope_width - 1).bit_length())
    block_h = min(max(16, 1 << (heads - 1).bit_length()), max(16, ACC_ELEMENTS // block_w))
    # fp32 rows are twice as wide: half the tokens per step keeps the pipelined KV tiles
    # (num_stages of them in shared memory) the size of the 16-bit ones.
    block_n = 16 if dtype == torch.float32 else 32
    return Tiles(block_h, block_n, block_w, block_r)


def choose_num_splits(batch: int, head_tiles: int, max_tokens: int, sm_count: int) -> int:
    """Splits per sequence: enough programs for two per SM, no split under MIN_SPLIT_TOKENS.

    Only Python ints the caller already has (the block table's width, the device's SM count),
    so choosing never waits for the device. A guess, not yet tuned on a GPU.
    """
    by_length = max_tokens // MIN_SPLIT_TOKENS
    by_occupancy = math.ceil(2 * sm_count / max(batch * head_tiles, 1))
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def _split_kv_kernel(
    Q,  # [B, H, W + R] contiguous
    KV,  # [slots, W + R], rows `stride_kv` apart
    BlockIds,  # [B, max_blocks], rows `stride_bt` apart
    Lengths,  # [B]
    PartO,  # [B, H, splits, W] fp32
    PartLse,  # [B, H, splits] fp32
    num_heads,
    max_blocks,
    stride_kv,
    stride_bt,
    W: tl.constexpr,
    R: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BF16_AS_FP32: tl.constexpr,
):
    b = tl.program_id(0)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < num_heads
    offs_w = tl.arange(0, BLOCK_W)
    mask_w = offs_w < W
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R

    # Clamped to the table so that a bad length can never read past it; never negative.
    length = tl.load(Lengths + b).to(tl.int32)
    length = tl.maximum(tl.minimum(length, max_blocks * BLOCK_SIZE), 0)
    # Each sequence is cut into equal spans of whole token tiles, so a short sequence leaves
    # its last splits empty (they write lse = -inf below).
    span = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = split * span
    end = tl.minimum(start + span, length)

    q_rows = Q + (b * num_heads + heads)[:, None] * (W + R)
    q_lat = tl.load(q_rows + offs_w[None, :], mask=mask_h[:, None] & mask_w[None, :], other=0.0)
    q_pe = tl.load(q_rows + W + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)

    if BF16_AS_FP32:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    row_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_W], dtype=tl.float32)
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + tl.arange(0, BLOCK_N)
        valid = tok < end
        block = tl.load(BlockIds + b * stride_bt + tok // BLOCK_SIZE, mask=valid, other=0)
        # int64 before the row stride: slots * (W + R) overflows int32 in a large pool.
        slot = block.to(tl.int64) * BLOCK_SIZE + tok % BLOCK_SIZE
        kv_rows = KV + slot[:, None] * stride_kv
        n = tl.load(kv_rows + offs_w[None, :], mask=valid[:, None] & mask_w[None, :], other=0.0)
        k_pe = tl.load(
            kv_rows + W + offs_r[None, :], mask=valid[:, None] & mask_r[None, :], other=0.0
        )
        if BF16_AS_FP32:
            n = n.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        # One load of n serves both products: transposed for the scores, as is for the values.
        scores = tl.dot(q_lat, tl.trans(n), input_precision=DOT_PRECISION)
        scores = tl.dot(q_pe, tl.trans(k_pe), acc=scores, input_precision=DOT_PRECISION)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        # Every step holds at least one valid token, so the new max is finite for every row
        # (padded heads score 0) and no exp sees -inf - -inf.
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        rescale = tl.exp(row_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(p, axis=1)
        # p is rounded to the cache's dtype for the tensor-core product, as flash kernels do.
        p_low = p.to(KV.dtype.element_ty)
        if BF16_AS_FP32:
            p_low = p_low.to(tl.float32)
        acc = tl.dot(p_low, n, acc=acc * rescale[:, None], input_precision=DOT_PRECISION)
        row_max = new_max

    # A split with no token keeps acc = 0, row_sum = 0 and row_max = -inf: it stores u = 0 and
    # lse = -inf (never 0 / 0), and weighs exp(-inf) = 0 in the merge.
    safe_sum = tl.where(row_sum > 0.0, row_sum, 1.0)
    out = acc / safe_sum[:, None]
    lse = row_max + tl.log(safe_sum)
    part = (b * num_heads + heads) * num_splits + split
    tl.store(
        PartO + part[:, None] * W + offs_w[None, :], out, mask=mask_h[:, None] & mask_w[None, :]
    )
    tl.store(PartLse + part, lse, mask=mask_h)


def _merge_splits_kernel(
    PartO,  # [B, H, splits, W] fp32
    PartLse,  # [B, H, splits] fp32
    U,  # [B, H, W] in the query's dtype
    Lse,  # [B, H] fp32
    num_splits,
    W: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    offs_w = tl.arange(0, BLOCK_W)
    mask_w = offs_w < W
    lse_row = PartLse + row * num_splits

    top = float("-inf")
    for s in range(0, num_splits):
        top = tl.maximum(top, tl.load(lse_row + s))
    # No split holds a token (length 0): shift by 0 so that every weight is exp(-inf) = 0.
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = 0.0
    acc = tl.zeros([BLOCK_W], dtype=tl.float32)
    for s in range(0, num_splits):
        weight = tl.exp(tl.load(lse_row + s) - shift)
        part = tl.load(PartO + (row * num_splits + s) * W + offs_w, mask=mask_w, other=0.0)
        acc += weight * part
        total += weight
    safe_total = tl.where(total > 0.0, total, 1.0)
    u = acc / safe_total
    tl.store(U + row * W + offs_w, u.to(U.dtype.element_ty), mask=mask_w)
    tl.store(Lse + row, tl.where(total > 0.0, shift + tl.log(safe_total), float("-inf")))


@functools.cache
def kernels() -> tuple[Any, Any]:
    """(stage 1, stage 2) wrapped in this process's mode (`triton_mode.wrap`)."""
    # The table's width, its row stride and the split count change with the step's bucket;
    # specialized (== 1, a multiple of 16) each would be another compiled variant.
    return (
        wrap(_split_kv_kernel, do_not_specialize=("max_blocks", "stride_bt")),
        wrap(_merge_splits_kernel, do_not_specialize=("num_splits",)),
    )


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full fp32 ("ieee"): TF32 would round them to 10 mantissa bits
    and fp32 is the dtype that must match the reference closely. 16-bit inputs ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(
    q: Tensor, kv: Tensor, block_ids: Tensor, lengths: Tensor, block_size: int, rope_width: int
) -> None:
    """Shape, dtype and device checks: only what the caller's Python objects already say."""
    if q.dim() != 3 or kv.dim() != 2:
        raise ValueError(
            f"q must be [B, H, W + R] and kv [slots, W + R], got {q.shape}, {kv.shape}"
        )
    if q.shape[-1] != kv.shape[-1]:
        raise ValueError(f"q has {q.shape[-1]} columns but kv rows have {kv.shape[-1]}")
    if not 0 < rope_width < q.shape[-1]:
        raise ValueError(f"rope_width {rope_width} must lie in (0, {q.shape[-1]})")
    if q.dtype not in FLOAT_DTYPES or kv.dtype != q.dtype:
        raise ValueError(f"q and kv must share one of fp32/bf16/fp16, got {q.dtype}, {kv.dtype}")
    if block_ids.dim() != 2 or block_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"block_ids must be [B, nb] int32/int64, got {block_ids.dtype} {block_ids.shape}"
        )
    if lengths.dim() != 1 or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lengths must be [B] int32/int64, got {lengths.dtype} {lengths.shape}")
    if not block_ids.shape[0] == lengths.shape[0] == q.shape[0]:
        raise ValueError(
            f"batch sizes differ: q {q.shape[0]}, block_ids {block_ids.shape[0]}, "
            f"lengths {lengths.shape[0]}"
        )
    if block_size < 1 or kv.shape[0] % block_size:
        raise ValueError(f"kv has {kv.shape[0]} slots, not whole blocks of {block_size}")
    if kv.stride(-1) != 1:
        raise ValueError("kv rows must be contiguous (stride 1 along W + R)")
    devices = {t.device for t in (q, kv, block_ids, lengths)}
    if len(devices) != 1:
        raise ValueError(f"tensors on different devices: {sorted(map(str, devices))}")


def paged_decode_attention(
    q: Tensor,
    kv: Tensor,
    block_ids: Tensor,
    lengths: Tensor,
    block_size: int,
    num_splits: int | None = None,
    *,
    rope_width: int,
) -> tuple[Tensor, Tensor]:
    """Decode attention of one query per sequence over its paged latent cache slice.

    q [B, H, W + R]: absorbed queries, scale (and 1/beta on the latent part) folded in.
    kv [slots, W + R]: one layer of the paged cache, row = [n | k_pe], slot = block *
    block_size + offset. block_ids [B, nb] int32/int64: token t of sequence b is at slot
    block_ids[b, t // block_size] * block_size + t % block_size, for t < lengths[b] (which may
    be 0; lengths past nb * block_size are clamped to it). `rope_width` is R; W = q.shape[-1]
    - R. num_splits: split-KV programs per sequence; None chooses from the table's width and
    the batch, 1 does not split. Returns u [B, H, W] in q's dtype (softmax-weighted sum of n)
    and lse [B, H] fp32 (-inf where a sequence has no tokens, with u = 0). Never waits for the
    device (block ids in range are the caller's contract, as for every paged kernel); runs on
    CUDA tensors, or CPU tensors under TRITON_INTERPRET=1, and is an error anywhere else."""
    _check(q, kv, block_ids, lengths, block_size, rope_width)
    _check_runnable(q, num_splits)
    batch, heads, cols = q.shape
    width = cols - rope_width
    u = q.new_empty(batch, heads, width)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=q.device)
    if batch == 0 or heads == 0:
        return u, lse
    tiles = choose_tiles(heads, width, rope_width, q.dtype)
    head_tiles = math.ceil(heads / tiles.block_h)
    if num_splits is None:
        num_splits = _num_splits(q, head_tiles, block_ids.shape[1] * block_size)
    # The index tensors are [B, nb] and [B]: contiguous() is a no-op for the engine's own.
    q, block_ids, lengths = q.contiguous(), block_ids.contiguous(), lengths.contiguous()
    part_o = torch.empty(batch, heads, num_splits, width, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    split_kv, merge = kernels()
    # Triton launches on the current CUDA device, which need not be the tensors' one.
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        split_kv[(batch, head_tiles, num_splits)](
            q,
            kv,
            block_ids,
            lengths,
            part_o,
            part_lse,
            heads,
            block_ids.shape[1],
            kv.stride(0),
            block_ids.stride(0),
            W=width,
            R=rope_width,
            BLOCK_SIZE=block_size,
            BLOCK_H=tiles.block_h,
            BLOCK_N=tiles.block_n,
            BLOCK_W=tiles.block_w,
            BLOCK_R=tiles.block_r,
            DOT_PRECISION=dot_precision(q.dtype),
            # Triton's interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton
            # #11584): it gets fp32 copies of the exactly representable bf16 values instead.
            BF16_AS_FP32=not q.is_cuda and q.dtype == torch.bfloat16,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
            enable_fp_fusion=True,
        )
        merge[(batch, heads)](
            part_o,
            part_lse,
            u,
            lse,
            num_splits,
            W=width,
            BLOCK_W=tiles.block_w,
            num_warps=MERGE_WARPS,
            num_stages=MERGE_STAGES,
            enable_fp_fusion=True,
        )
    return u, lse


def _num_splits(q: Tensor, head_tiles: int, width_tokens: int) -> int:
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
    return choose_num_splits(q.shape[0], head_tiles, width_tokens, sms)


def _check_runnable(q: Tensor, num_splits: int | None) -> None:
    """The kernel can run on q's device in this process with `num_splits`, else the error
    that says why."""
    if num_splits is not None and not 1 <= num_splits <= MAX_GRID_Z:
        raise ValueError(f"num_splits must lie in [1, {MAX_GRID_Z}], got {num_splits}")
    check_runnable(q.device, "the Triton decode kernel")


def paged_decode_attention_reference(
    q: Tensor,
    kv: Tensor,
    block_ids: Tensor,
    lengths: Tensor,
    block_size: int,
    *,
    rope_width: int,
) -> tuple[Tensor, Tensor]:
    """`paged_decode_attention` in plain torch: gather each token's row, einsum, fp32 math."""
    _check(q, kv, block_ids, lengths, block_size, rope_width)
    width = q.shape[-1] - rope_width
    pos = torch.arange(block_ids.shape[1] * block_size, device=q.device)
    valid = pos[None] < lengths[:, None]  # [B, T]
    # Table entries past a sequence's end may hold anything (padding): never dereference them.
    slots = token_slots(block_ids.long(), pos.expand(len(lengths), -1), block_size)
    rows = kv[slots.masked_fill(~valid, 0)].float()  # [B, T, W + R]
    scores = torch.einsum("bhc,btc->bht", q.float(), rows)
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf for a sequence with no tokens
    p = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    u = torch.einsum("bht,btc->bhc", p, rows[..., :width])
    return u.to(q.dtype), lse
