"""INT4-resident weights: routed experts kept as compressed-tensors' pack-quantized INT4 (Kimi
K2-Thinking, K2.5, K2.6), dequantized on use.

The format and its one dequantization are common/triton_kernels/int4_packing.py's
(`dequantize_int4`: the reader's dequantize-at-load calls it too, so the two agree bit for
bit). It writes into a buffer of the compute dtype one expert at a time, and a model's INT4
weights share the FP8 weights' workspace: one buffer per role and shape, reused by every
layer. Where the device runs it, the W4A16 Triton grouped GEMM reads a stack of experts as
stored instead (common/model/int4_experts.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from common.model.fp8 import DequantizedOnUse
from common.triton_kernels.int4_packing import INT4_PACK, dequantize_int4


class Int4Weight(DequantizedOnUse):
    """A weight of logical `shape` [..., R, C] kept as packed INT4 with its group scales;
    computes in `dtype`. Stands in for a stacked expert tensor (or an `nn.Linear`)."""

    def __init__(
        self, packed: Tensor, scale: Tensor, group: int, dtype: torch.dtype, role: str
    ) -> None:
        super().__init__()
        assert packed.dtype == torch.int32 and packed.shape[:-1] == scale.shape[:-1]
        assert packed.shape[-1] * INT4_PACK == scale.shape[-1] * group
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)
        self.group, self.dtype, self.role = group, dtype, role
        self.shape = (*packed.shape[:-1], packed.shape[-1] * INT4_PACK)

    packed: Tensor
    scale: Tensor

    def dequantize(self, out: Tensor | None = None) -> Tensor:
        """The weight in `dtype`, written into `out` (default: the workspace's buffer for this
        role, overwritten by the next weight of the same role)."""
        if out is None:
            out = self.workspace.buffer(self.role, self.shape, self.dtype, self.packed.device)
        return dequantize_int4(self.packed, self.scale, self.group, out.view(self.shape))

    def dequantize_experts(self, start: int, stop: int, capacity: int) -> Tensor:
        p = self.packed
        assert p.dim() == 3 and 0 <= start < stop <= p.shape[0] and stop - start <= capacity
        key = (capacity, *self.shape[1:])
        out = self.workspace.buffer(self.role, key, self.dtype, p.device)[: stop - start]
        return dequantize_int4(p[start:stop], self.scale[start:stop], self.group, out)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.dequantize())


def stack_int4(build: Callable[[int], Int4Weight], count: int, role: str) -> Int4Weight:
    """`count` experts' weights of one shape, sliced alike, stacked [E, R, C]: `build(e)`
    makes expert e's, copied in one at a time (the stack is never held twice)."""
    first = build(0)
    packed = first.packed.new_empty((count, *first.packed.shape))
    scale = first.scale.new_empty((count, *first.scale.shape))
    for e in range(count):
        part = first if e == 0 else build(e)
        packed[e], scale[e] = part.packed, part.scale
        del part
    return Int4Weight(packed, scale, first.group, first.dtype, role)


def cat_int4_rows(parts: list[Int4Weight], role: str) -> Int4Weight:
    """`parts` one after the other along their rows (gate rows, then up rows)."""
    first = parts[0]
    return Int4Weight(
        torch.cat([p.packed for p in parts], dim=-2),
        torch.cat([p.scale for p in parts], dim=-2),
        first.group,
        first.dtype,
        role,
    )
