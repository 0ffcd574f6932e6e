"""A MoE layer's FP8 routed experts multiplied in FP8: the Triton block-scaled grouped GEMM
(common/triton_kernels/fp8_grouped_gemm.py), with no dequantized copy of the weights.

The kernel reads each held expert's e4m3 values and block scales as loaded (`block_fp8`: the
weight's scale rows and the scale column of each 128-column group, laid out once when the
layer settles its kernel). The activations are quantized on the device per 1 x 128 group
(`quantize_groups`, as scaled_mm's are): x once per token (the kernel gathers each sorted
row's token), then the SiLU * up product of every row; the routing weights scale it before
the down projection, as in `grouped_experts`, and `combine` sums each token's rows. No host
read: a static routing keeps every shape a function of T.

Not bit-equal to dequantize-then-GEMM, by design (the activations keep 3 mantissa bits, as
under scaled_mm); tests/unit/common/model/test_fp8_experts.py states the tolerance.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from common.model.expert_routing import Routing, combine
from common.model.fp8 import Fp8Weight, Weight
from common.model.fp8_gemm import quantize_groups
from common.triton_kernels import triton_mode
from common.triton_kernels.fp8_grouped_gemm import GROUP, BlockFp8, fp8_grouped_mm

# FP8 tensor-core products (mma on sm_89, wgmma on sm_90, and newer) as Triton compiles them.
MIN_CAPABILITY = (8, 9)


def kernel_unsupported(device: torch.device) -> str | None:
    """Why the Triton FP8 grouped GEMM cannot run on `device` in this process, or None."""
    if not triton_mode.triton_installed():
        return "triton is not installed (pip install triton)"
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            major, minor = capability
            return f"sm_{major}{minor}: FP8 tensor cores need sm_89 or newer"
        return None
    if device.type == "cpu" and triton_mode.interpreting():
        return None
    return "Triton kernels run on CUDA devices, or on the CPU under TRITON_INTERPRET=1"


def block_fp8(w: Fp8Weight) -> BlockFp8 | str:
    """A stacked FP8 expert weight as the kernel reads it, or why the kernel cannot take it:
    each 128-column activation group must lie inside one stored column block."""
    assert isinstance(w, Fp8Weight)
    if w.values.dim() != 3 or not w.values.is_contiguous():
        return "not a contiguous stack of experts"
    bc = w.block[1]
    if bc % GROUP or w.col_offset % GROUP:
        return (
            f"{bc}-column blocks from column {w.col_offset}: a {GROUP}-column activation group "
            "would straddle two weight scales"
        )
    device = w.values.device
    k = w.values.shape[-1]
    rows = w.workspace.row_blocks(w.rows, w.block[0], device).int()
    cols = (w.col_offset + GROUP * torch.arange(math.ceil(k / GROUP), device=device)) // bc
    return BlockFp8(w.values, w.scale, rows, cols.int())


class Fp8GroupedExperts:
    """The routed experts of one layer on the Triton kernel: its two weights' layouts, made
    when the layer settles its kernel (a `RoutedExperts`, common/model/experts.py)."""

    def __init__(self, gate_up: BlockFp8, down: BlockFp8) -> None:
        self.gate_up, self.down = gate_up, down

    def __call__(self, x: Tensor, r: Routing, gate_up: Weight, down: Weight) -> Tensor:
        two_i = self.gate_up.values.shape[1]
        a, a_scale = quantize_groups(x)
        gu = fp8_grouped_mm(a, a_scale, r.ends, self.gate_up, x.dtype, r.token.int())
        gate, up = gu.split(two_i // 2, dim=-1)
        h = F.silu(gate) * up * r.weight[:, None]
        # Rows past the last group are uninitialized: quantized as anything, never kept.
        b, b_scale = quantize_groups(h)
        return combine(r, fp8_grouped_mm(b, b_scale, r.ends, self.down, x.dtype))
