"""Which kernel runs a MoE layer's routed experts: the selector, then each layer's settling.

`select_experts_kernel` is the selector (TPLA_EXPERTS_KERNEL, by the rule of
common/runtime/kernel_choice.py), once per model for its device and compute dtype:
`triton_fp8` (the Triton FP8 block-scaled grouped GEMM, common/model/fp8_experts.py) where it
runs, `grouped` where this torch runs `grouped_mm` on the device in the dtype, else `loop`.
`auto` tries triton_fp8 on CUDA only (on the CPU it runs under Triton's interpreter, named).

`settle` then decides, per layer and for its weights as placed, what runs: `triton_fp8` runs
FP8 experts whose blocks it can read and falls back to `grouped` otherwise (weights that are
not FP8, column blocks a 128-column group would straddle); `grouped` runs weights whose
strides grouped_mm takes, else the loop. FP8 weights that no FP8 kernel runs are
dequantized a bounded group of experts at a time (common/model/experts.py), and only there
does a layer hold a dequantization buffer.
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
from common.runtime.kernel_choice import KernelChoice, choose_kernel, setting_of
from common.triton_kernels.fp8_blocks import BlockFp8, unsupported

EXPERTS_KERNELS = ("triton_fp8", "grouped", "loop")
NOT_FP8 = "the experts are not FP8"


def select_experts_kernel(asked: str, device: torch.device, dtype: torch.dtype) -> KernelChoice:
    """The routed experts' kernel for weights on `device` computing in `dtype`
    (TPLA_EXPERTS_KERNEL: auto | triton_fp8 | grouped | loop), by the kernel-choice rule."""
    checks = {
        "triton_fp8": lambda: unsupported(device),
        "grouped": lambda: grouped_unsupported_on(device, dtype),
        "loop": lambda: None,
    }
    auto = EXPERTS_KERNELS if device.type == "cuda" else EXPERTS_KERNELS[1:]
    return choose_kernel("experts", asked, checks, auto)


def _fp8_blocks(gate_up: Weight, down: Weight) -> tuple[BlockFp8, BlockFp8] | str:
    """Both weights as the Triton FP8 kernel reads them, or why it cannot."""
    if not (isinstance(gate_up, Fp8Weight) and isinstance(down, Fp8Weight)):
        return NOT_FP8
    if gate_up.values.dim() != 3 or down.values.dim() != 3:
        return "not stacks of experts"
    gate_up_blocks, down_blocks = gate_up.block_fp8(), down.block_fp8()
    if isinstance(gate_up_blocks, str):
        return gate_up_blocks
    if isinstance(down_blocks, str):
        return down_blocks
    return gate_up_blocks, down_blocks


def loop_reason(kernel: str, gate_up: Weight, down: Weight) -> str | None:
    """Why these weights run the per-expert loop under the chosen `kernel`, or None."""
    if kernel == "loop":
        return f"the loop was chosen ({setting_of('experts')})"
    if kernel == "triton_fp8" and not isinstance(_fp8_blocks(gate_up, down), str):
        return None
    return grouped_unsupported(gate_up, down)


def settle(kernel: str, gate_up: Weight, down: Weight) -> tuple[RoutedExperts, str]:
    """What runs these weights under the chosen `kernel`, and how it reads: "triton_fp8",
    "grouped" (FP8: with its dequantized group size) or "loop: why"."""
    fp8_why = None
    if kernel == "triton_fp8":
        blocks = _fp8_blocks(gate_up, down)
        if not isinstance(blocks, str):
            return Fp8GroupedExperts(*blocks), "triton_fp8"
        fp8_why = blocks
    why = loop_reason(kernel, gate_up, down)
    if why is not None:
        return routed_experts, f"loop: {why}"
    how = "grouped"
    if isinstance(gate_up, DequantizedOnUse):
        how += f", dequantized {experts_per_group(gate_up, down)} experts at a time"
    if fp8_why is not None and fp8_why != NOT_FP8:
        how += f" (triton_fp8: {fp8_why})"
    return grouped_experts, how
