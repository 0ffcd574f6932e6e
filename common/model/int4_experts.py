"""A MoE layer's INT4 routed experts multiplied as stored: the Triton W4A16 grouped GEMM
(common/triton_kernels/int4_grouped_gemm.py), with no dequantized copy of the weights.

The kernel reads each held expert's int32 words and group scales as loaded (`Int4Weight`'s
`packed` and `scale`) and dequantizes a tile at a time in the activations' dtype, bit for
bit as `dequantize_int4` does: x's rows gathered by token through gate_up, SiLU * up scaled
by the routing weights (in x's dtype, as `grouped_experts` rounds it), then down, and
`combine` sums each token's rows. No host read: a static routing keeps every shape a
function of T. Against dequantize-then-GEMM only the order of the fp32 sums differs
(tests/unit/common/model/test_int4_experts.py).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from common.model.expert_routing import Routing, combine
from common.model.fp8 import Weight
from common.model.int4 import Int4Weight


class Int4GroupedExperts:
    """The routed experts of one layer on the W4A16 kernel: its two INT4 stacks, taken when
    the layer settles its kernel (a `RoutedExperts`, common/model/experts.py)."""

    def __init__(self, gate_up: Int4Weight, down: Int4Weight) -> None:
        # Imported once the kernel is chosen: triton loads only where it runs.
        from common.triton_kernels.int4_grouped_gemm import int4_grouped_mm

        self.gate_up, self.down, self.mm = gate_up, down, int4_grouped_mm

    def __call__(self, x: Tensor, r: Routing, gate_up: Weight, down: Weight) -> Tensor:
        w1, w2 = self.gate_up, self.down
        gu = self.mm(x, r.ends, w1.packed, w1.scale, w1.group, x.dtype, r.token.int())
        gate, up = gu.split(w1.shape[1] // 2, dim=-1)
        # Rows past the last group are uninitialized: multiplied as anything, never kept.
        h = (F.silu(gate) * up * r.weight[:, None]).to(x.dtype)
        return combine(r, self.mm(h, r.ends, w2.packed, w2.scale, w2.group, x.dtype))
