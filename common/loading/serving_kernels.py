"""The kernels a serving model runs, chosen at start-up for its device and dtype by the rule
of common/runtime/kernel_choice.py from what its config asks (`KernelConfig`).

`WeightKernels` are the choices every serving model makes over its weights (the FP8 GEMM, the
routed experts' kernel): a decode rank's (services/decode/rank/runtime.py, beside its decode
backend) and a prefill model's. `PrefillKernels` adds a prefill model's attention. Each is
chosen before the weights load (a kernel named that cannot run stops the start-up there) and
applied once they are placed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from common.model.experts_kernel import select_experts_kernel
from common.model.fp8_gemm import assign_gemms, select_fp8_gemm
from common.model.moe import use_experts_kernel
from common.model.prefill_attention import (
    PrefillAttention,
    make_prefill_attention,
    select_prefill_attention,
)
from common.runtime.kernel_choice import KernelChoice, KernelConfig


@dataclass(frozen=True)
class WeightKernels:
    """How a model's weights are applied: its FP8 GEMM and its routed experts' kernel."""

    fp8_gemm: KernelChoice
    experts: KernelChoice

    @classmethod
    def select(
        cls, kernels: KernelConfig, device: torch.device, dtype: torch.dtype
    ) -> WeightKernels:
        return cls(
            select_fp8_gemm(kernels.fp8_gemm, device),
            select_experts_kernel(kernels.experts, device, dtype),
        )

    @property
    def choices(self) -> tuple[KernelChoice, ...]:
        return self.fp8_gemm, self.experts

    def apply(self, model: nn.Module) -> None:
        """Give `model`'s FP8 weights and MoE layers their kernels, once they are placed."""
        assign_gemms(model, self.fp8_gemm.kernel)
        use_experts_kernel(model, self.experts.kernel)


@dataclass(frozen=True)
class PrefillKernels:
    """A prefill model's kernels: its attention and its weights'."""

    attention: KernelChoice
    weights: WeightKernels

    @classmethod
    def select(
        cls, kernels: KernelConfig, device: torch.device | str, dtype: torch.dtype
    ) -> PrefillKernels:
        dev = torch.device(device)
        attention = select_prefill_attention(kernels.prefill_attention, dev, dtype)
        return cls(attention, WeightKernels.select(kernels, dev, dtype))

    @property
    def choices(self) -> tuple[KernelChoice, ...]:
        return self.attention, *self.weights.choices

    def attention_backend(self) -> PrefillAttention:
        return make_prefill_attention(self.attention.kernel)
