"""A MoE layer's FP8 routed experts multiplied in FP8: the Triton block-scaled grouped GEMM
(common/triton_kernels/fp8_grouped_gemm.py), with no dequantized copy of the weights.

The kernel reads each held expert's e4m3 values and block scales as loaded
(`Fp8Weight.block_fp8`: the weight's scale rows and the scale column of each 128-column
group, laid out once when the layer settles its kernel). The activations are quantized on
the device per 1 x 128 group (`quantize_groups`, as scaled_mm's are): x once per token (the
kernel gathers each sorted row's token), then the SiLU * up product of every row; the
routing weights scale it before the down projection, as in `grouped_experts`, and `combine`
sums each token's rows. No host read: a static routing keeps every shape a function of T.

Not bit-equal to dequantize-then-GEMM, by design (the activations keep 3 mantissa bits, as
under scaled_mm); tests/unit/common/model/test_fp8_experts.py states the tolerance.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from common.model.expert_routing import Routing, combine
from common.model.fp8 import Weight
from common.model.fp8_gemm import quantize_groups
from common.triton_kernels.fp8_blocks import BlockFp8


class Fp8GroupedExperts:
    """The routed experts of one layer on the Triton kernel: its two weights' layouts, made
    when the layer settles its kernel (a `RoutedExperts`, common/model/experts.py)."""

    def __init__(self, gate_up: BlockFp8, down: BlockFp8) -> None:
        # Imported once the kernel is chosen: triton loads only where it runs.
        from common.triton_kernels.fp8_grouped_gemm import fp8_grouped_mm

        self.gate_up, self.down, self.mm = gate_up, down, fp8_grouped_mm

    def __call__(self, x: Tensor, r: Routing, gate_up: Weight, down: Weight) -> Tensor:
        two_i = self.gate_up.values.shape[1]
        a, a_scale = quantize_groups(x)
        gu = self.mm(a, a_scale, r.ends, self.gate_up, x.dtype, r.token.int())
        gate, up = gu.split(two_i // 2, dim=-1)
        h = F.silu(gate) * up * r.weight[:, None]
        # Rows past the last group are uninitialized: quantized as anything, never kept.
        b, b_scale = quantize_groups(h)
        return combine(r, self.mm(b, b_scale, r.ends, self.down, x.dtype))
