"""Which kernel runs a MoE layer's routed experts: the selector, then each layer's settling.

`select_experts_kernel` is the selector (TPLA_EXPERTS_KERNEL, by the rule of
common/runtime/kernel_choice.py), once per model for its device and compute dtype:
`triton` (the Triton grouped GEMM over quantized experts: FP8 blocks,
common/model/fp8_experts.py, or INT4 groups as W4A16, int4_experts.py) where it runs,
`grouped` where this torch runs `grouped_mm` on the device in the dtype, else `loop`.
`auto` tries triton on CUDA only (on the CPU it runs under Triton's interpreter, named).

`settle` then decides, per layer and for its weights as placed, what runs: `triton` runs
FP8 experts whose blocks it can read and INT4 experts, and falls back to `grouped` otherwise
(weights that are neither, column blocks a 128-column group would straddle); `grouped` runs
weights whose strides grouped_mm takes, else the loop. Quantized weights that no Triton
kernel runs are dequantized a bounded group of experts at a time (common/model/experts.py),
and only there does a layer hold a dequantization buffer.
"""

from __future__ import annotations

import torch

from common.model.experts import (
    RoutedExperts,
    experts_per_group,
    grouped_experts,
    grouped_unsupported,
    grouped_unsupported_on,
    routed_experts,
)
from common.model.fp8 import DequantizedOnUse, Fp8Weight, Weight
from common.model.fp8_experts import Fp8GroupedExperts
from common.model.int4 import Int4Weight
from common.model.int4_experts import Int4GroupedExperts
from common.runtime.kernel_choice import KernelChoice, choose_kernel, setting_of
from common.triton_kernels import fp8_blocks, int4_grouped_gemm

EXPERTS_KERNELS = ("triton", "grouped", "loop")
NOT_QUANTIZED = "the experts are neither FP8 nor INT4"


def select_experts_kernel(asked: str, device: torch.device, dtype: torch.dtype) -> KernelChoice:
    """The routed experts' kernel for weights on `device` computing in `dtype`
    (TPLA_EXPERTS_KERNEL: auto | triton | grouped | loop), by the kernel-choice rule. The
    Triton kernels are offered where the W4A16 one runs (sm_80+); the FP8 one needs FP8
    tensor cores (sm_89+), and FP8 experts below that settle to `grouped`, saying why."""
    checks = {
        "triton": lambda: int4_grouped_gemm.unsupported(device),
        "grouped": lambda: grouped_unsupported_on(device, dtype),
        "loop": lambda: None,
    }
    auto = EXPERTS_KERNELS if device.type == "cuda" else EXPERTS_KERNELS[1:]
    return choose_kernel("experts", asked, checks, auto)


def _triton_experts(gate_up: Weight, down: Weight) -> tuple[RoutedExperts, str] | str:
    """The Triton kernel that reads both weights as stored and how it reads them, or why
    none can."""
    if isinstance(gate_up, Int4Weight) and isinstance(down, Int4Weight):
        if len(gate_up.shape) != 3 or len(down.shape) != 3:
            return "not stacks of experts"
        return Int4GroupedExperts(gate_up, down), f"triton (INT4, groups of {gate_up.group})"
    if not (isinstance(gate_up, Fp8Weight) and isinstance(down, Fp8Weight)):
        return NOT_QUANTIZED
    device = gate_up.values.device  # the selector has checked the rest of its environment
    if device.type == "cuda" and (why := fp8_blocks.unsupported(device)) is not None:
        return why  # a GPU with 16-bit tensor cores only (sm_80)
    if gate_up.values.dim() != 3 or down.values.dim() != 3:
        return "not stacks of experts"
    gate_up_blocks, down_blocks = gate_up.block_fp8(), down.block_fp8()
    if isinstance(gate_up_blocks, str):
        return gate_up_blocks
    if isinstance(down_blocks, str):
        return down_blocks
    return Fp8GroupedExperts(gate_up_blocks, down_blocks), "triton (FP8 blocks)"


def loop_reason(kernel: str, gate_up: Weight, down: Weight) -> str | None:
    """Why these weights run the per-expert loop under the chosen `kernel`, or None."""
    if kernel == "loop":
        return f"the loop was chosen ({setting_of('experts')})"
    if kernel == "triton" and not isinstance(_triton_experts(gate_up, down), str):
        return None
    return grouped_unsupported(gate_up, down)


def settle(kernel: str, gate_up: Weight, down: Weight) -> tuple[RoutedExperts, str]:
    """What runs these weights under the chosen `kernel`, and how it reads: "triton (FP8
    blocks)", "triton (INT4, groups of G)", "grouped" (quantized: with its dequantized group
    size) or "loop: why"."""
    triton_why = None
    if kernel == "triton":
        found = _triton_experts(gate_up, down)
        if not isinstance(found, str):
            return found
        triton_why = found
    why = loop_reason(kernel, gate_up, down)
    if why is not None:
        return routed_experts, f"loop: {why}"
    how = "grouped"
    if isinstance(gate_up, DequantizedOnUse):
        how += f", dequantized {experts_per_group(gate_up, down)} experts at a time"
    if triton_why is not None and triton_why != NOT_QUANTIZED:
        how += f" (triton: {triton_why})"
    return grouped_experts, how
