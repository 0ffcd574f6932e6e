"""FP8 weights multiplied in FP8, DeepSeek's recipe: torch's block-scaled `scaled_mm`, or the
Triton block-scaled GEMM where torch cannot run the recipe.

The weight W [N, K] keeps its e4m3 values and block scales; the activation is quantized on the
device per 1 x 128 group of its columns (`quantize_groups`: no host sync, so a CUDA graph
captures it), and the GEMM multiplies the two e4m3 operands with fp32 accumulation, applying
both scales: cuBLAS's `scaled_mm` (`ScaledGemm`), which torch runs on sm_90 only with
cuBLASLt 12.9 or later (`unsupported`), or the Triton kernel of the routed experts with one
group of rows (`TritonGemm`, common/triton_kernels/fp8_grouped_gemm.py: sm_89 and newer).

`select_fp8_gemm` is the selector (TPLA_FP8_GEMM, by the rule of
common/runtime/kernel_choice.py): `scaled_mm` where the device runs it, else `triton` where it
runs (CUDA only under auto), else `dequantize`. `assign_gemms` then applies the choice once
per weight, at load: a weight whose slice the chosen GEMM can read gets its module, which
its `Fp8Weight.forward` then calls; any other keeps dequantize-on-use, with the reason
logged: for scaled_mm columns that start inside a block so that a 128-column group straddles
two weight scales, or sides that are not multiples of 16; for triton the straddling columns;
for both stacked experts (their own kernel: common/model/experts_kernel.py) and per-head
W_UK / W_UV.
"""

from __future__ import annotations

import logging
import math
from collections import Counter

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.model.fp8 import Fp8Weight
from common.runtime.kernel_choice import KernelChoice, choose_kernel
from common.triton_kernels import fp8_blocks
from common.triton_kernels.fp8_blocks import BlockFp8

log = logging.getLogger(__name__)

GROUP = 128  # activation columns per scale: DeepSeek's 1 x 128 groups
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
# An all-zero group gets this amax, so its scale is never 0 (0 / 0 would be NaN).
AMAX_FLOOR = 1e-12
# Activation rows are padded to a multiple of 16 (zero rows, cut from the output): cuBLASLt's
# operands and the 1 x 128 scales' leading dimension (the rows) stay 16-byte aligned for any
# batch, at the cost of at most 15 rows of a decode step's GEMM.
ROW_ALIGN = 16


def unsupported(device: torch.device) -> str | None:
    """Why block-scaled scaled_mm cannot run on `device`, or None where it can."""
    if device.type != "cuda":
        return f"{device.type} device: block-scaled scaled_mm runs on CUDA only"
    if not hasattr(F, "scaled_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"sm_{major}{minor}: torch runs the 1x128 / 128x128 recipe on sm_90 only"
    cuda = torch.version.cuda or "0.0"
    if tuple(int(p) for p in cuda.split(".")[:2]) < (12, 9):
        return f"CUDA {cuda}: the 1x128 / 128x128 recipe needs cuBLASLt 12.9 or later"
    return None


def quantize_groups(x: Tensor, rows: int | None = None) -> tuple[Tensor, Tensor]:
    """x [M, K] as e4m3 values [rows, K] and fp32 scales [rows, ceil(K / 128)] with
    x ~ values * scale, one scale per row and group of 128 columns (the last group may be
    partial): scale = amax / 448, values = x / scale, on x's device. Rows past M (up to `rows`,
    default M) are zeros. The scales are column-major (stride (1, rows)), the layout
    scaled_mm takes for a 1 x 128 operand."""
    m, k = x.shape
    rows = m if rows is None else rows
    groups = math.ceil(k / GROUP)
    padded = F.pad(x.float(), (0, groups * GROUP - k, 0, rows - m)).view(rows, groups, GROUP)
    scale = padded.abs().amax(dim=-1).clamp(min=AMAX_FLOOR) / E4M3_MAX
    # x / scale can round just past 448, which e4m3fn (no infinity) would turn into NaN.
    values = (padded / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    values = values.view(rows, groups * GROUP)[:, :k].contiguous()
    return values, scale.t().contiguous().t()


class ScaledGemm(nn.Module):
    """x @ W^T for an FP8 weight W [N, K] by scaled_mm, with W's scales laid out for `recipe`:
    "128x128", the stored blocks [round_up(K/128, 4), N/128] (stride (1, round_up(K/128, 4)));
    or "1x128", one scale per row and 128-column group [N, K/128] (stride (1, N))."""

    def __init__(self, scale: Tensor, recipe: str, dtype: torch.dtype) -> None:
        super().__init__()
        # Not in the state dict: it is derived from the weight's own scales at load.
        self.register_buffer("weight_scale", scale, persistent=False)
        self.recipe, self.dtype = recipe, dtype

    weight_scale: Tensor

    def forward(self, x: Tensor, values: Tensor) -> Tensor:
        n, k = values.shape
        flat = x.reshape(-1, k)
        m = flat.shape[0]
        a, a_scale = quantize_groups(flat, max(ROW_ALIGN, math.ceil(m / ROW_ALIGN) * ROW_ALIGN))
        recipes = {"1x128": F.ScalingType.BlockWise1x128, "128x128": F.ScalingType.BlockWise128x128}
        out = F.scaled_mm(
            a,  # row-major [rows, K]
            values.t(),  # column-major [K, N]: the stored [N, K] transposed, not copied
            a_scale,
            F.ScalingType.BlockWise1x128,
            self.weight_scale,
            recipes[self.recipe],
            output_dtype=self.dtype,
        )
        return out[:m].view(*x.shape[:-1], n)


def weight_scales(w: Fp8Weight) -> tuple[Tensor, str] | str:
    """`w`'s scales laid out for scaled_mm and the recipe they follow, or why scaled_mm
    cannot compute `w`. Rows and columns that start at block edges of a 128 x 128 checkpoint
    use its blocks as stored ("128x128"); other rows (a slice that starts mid-block, gate rows
    then up rows, a checkpoint of other row blocks) get one scale per row and 128-column group
    ("1x128"), which needs each group inside one stored column block."""
    if w.values.dim() != 2 or len(w.shape) != 2:
        return "not applied as one linear (stacked experts, per-head W_UK / W_UV)"
    if not w.values.is_contiguous():  # scaled_mm reads its transpose as column-major [K, N]
        return "values not contiguous"
    n, k = w.values.shape
    if n % 16 or k % 16:
        return f"{n} x {k}: scaled_mm needs both sides multiples of 16"
    br, bc = w.block
    first = w.col_offset + GROUP * torch.arange(math.ceil(k / GROUP))
    last = (first + GROUP - 1).clamp(max=w.col_offset + k - 1)
    if not torch.equal(first // bc, last // bc):
        return (
            f"columns from {w.col_offset} into a {bc}-wide block: a 128-column activation "
            "group would straddle two weight scales"
        )
    rows = torch.cat([r.base + (r.offset + torch.arange(r.length)) // br for r in w.rows])
    scale = w.scale
    at_edges = w.col_offset == 0 and torch.equal(rows, torch.arange(n) // br)
    if (br, bc) == (GROUP, GROUP) and at_edges:
        # The leading dimension padded to 4 scales (16 bytes), as cuBLASLt asks.
        return F.pad(scale, (0, -scale.shape[1] % 4)).t(), "128x128"
    per_row = scale[rows.to(scale.device)][:, (first // bc).to(scale.device)]
    return per_row.t().contiguous().t(), "1x128"


class TritonGemm(nn.Module):
    """x @ W^T for an FP8 weight W [N, K] by the Triton block-scaled GEMM, its rows one
    group: W's scales as stored, the scale row of each row and the scale column of each
    128-column group (`Fp8Weight.block_fp8`)."""

    def __init__(self, blocks: BlockFp8, dtype: torch.dtype) -> None:
        super().__init__()
        # Not in the state dict: views of the weight's own scales, and indices derived at load.
        self.register_buffer("weight_scale", blocks.scale, persistent=False)
        self.register_buffer("scale_rows", blocks.scale_rows, persistent=False)
        self.register_buffer("scale_cols", blocks.scale_cols, persistent=False)
        self.dtype = dtype
        # Imported once the kernel is chosen: triton loads only where it runs.
        from common.triton_kernels.fp8_grouped_gemm import fp8_grouped_mm

        self.mm = fp8_grouped_mm

    weight_scale: Tensor
    scale_rows: Tensor
    scale_cols: Tensor

    def forward(self, x: Tensor, values: Tensor) -> Tensor:
        n, k = values.shape
        flat = x.reshape(-1, k)
        a, a_scale = quantize_groups(flat)
        ends = torch.full((1,), flat.shape[0], dtype=torch.int32, device=x.device)
        w = BlockFp8(values[None], self.weight_scale, self.scale_rows, self.scale_cols)
        return self.mm(a, a_scale, ends, w, self.dtype).view(*x.shape[:-1], n)


def select_fp8_gemm(asked: str, device: torch.device) -> KernelChoice:
    """How FP8 weights on `device` are applied (TPLA_FP8_GEMM: auto | scaled_mm | triton |
    dequantize), by the kernel-choice rule; auto tries triton on CUDA only (on the CPU it
    runs under Triton's interpreter, named)."""
    checks = {
        "scaled_mm": lambda: unsupported(device),
        "triton": lambda: fp8_blocks.unsupported(device),
        "dequantize": lambda: None,
    }
    auto = (
        ("scaled_mm", "triton", "dequantize")
        if device.type == "cuda"
        else ("scaled_mm", "dequantize")
    )
    return choose_kernel("fp8_gemm", asked, checks, auto)


def _gemm_for(w: Fp8Weight, gemm: str) -> tuple[nn.Module, str] | str:
    """The module applying `w` under the chosen `gemm` and how it reads, or why none can."""
    if w.values.dim() != 2 or len(w.shape) != 2:
        return "not applied as one linear (stacked experts, per-head W_UK / W_UV)"
    if gemm == "triton":
        blocks = w.block_fp8()
        return blocks if isinstance(blocks, str) else (TritonGemm(blocks, w.dtype), "triton")
    layout = weight_scales(w)
    if isinstance(layout, str):
        return layout
    return ScaledGemm(*layout, w.dtype), f"scaled_mm ({layout[1]})"


def assign_gemms(model: nn.Module, gemm: str) -> dict[str, str]:
    """Apply the chosen FP8 GEMM (`select_fp8_gemm`: scaled_mm | triton | dequantize) to
    each FP8 weight of `model`, placed on its device: a weight gets the GEMM's module where
    its slice allows; the others dequantize on use, as do the weights a module names in its
    `dense_weights` (those it reads as tensors, never applies). Returns, per weight,
    "scaled_mm (recipe)", "triton" or "dequantize: why"."""
    chosen: dict[str, str] = {}
    for prefix, parent in model.named_modules():
        dense_weights = getattr(parent, "dense_weights", ())
        for leaf, w in parent.named_children():
            if not isinstance(w, Fp8Weight):
                continue
            name = f"{prefix}.{leaf}" if prefix else leaf
            w.gemm = None
            why = "dequantize was chosen" if gemm == "dequantize" else None
            if why is None and leaf in dense_weights:
                why = f"{type(parent).__name__} reads it as a tensor"
            found = _gemm_for(w, gemm) if why is None else why
            if isinstance(found, str):
                chosen[name] = f"dequantize: {found}"
            else:
                w.gemm, chosen[name] = found
    if chosen:
        counts = Counter(chosen.values())
        log.info("FP8 weights: %s", "; ".join(f"{c} x {how}" for how, c in counts.items()))
    return chosen
