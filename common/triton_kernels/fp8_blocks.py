"""What the Triton FP8 block-scaled GEMM (fp8_grouped_gemm.py) reads, importable without
triton: the weights' layout (`BlockFp8`), its activation group (`GROUP`) and the devices it
runs on (`unsupported`), so a model lays its weights out and a selector checks the device in
a process that never loads the kernel."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from common.triton_kernels import triton_mode

GROUP = 128  # activation columns per scale, and the K step: DeepSeek's 1 x 128 groups
# FP8 tensor-core products (mma on sm_89, wgmma on sm_90, and newer) as Triton compiles them.
MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class BlockFp8:
    """Stacked FP8 weights as the kernel reads them: `values` [E, N, K] float8_e4m3fn (each
    row contiguous), `scale` [E, SR, SC] fp32 (the stored blocks the values overlap),
    `scale_rows` [N] int32 (the scale row of each value row) and `scale_cols`
    [ceil(K / 128)] int32 (the scale column of each 128-column group)."""

    values: Tensor
    scale: Tensor
    scale_rows: Tensor
    scale_cols: Tensor

    def __post_init__(self) -> None:
        e, n, k = self.values.shape
        assert self.values.dtype == torch.float8_e4m3fn and self.values.stride(-1) == 1
        assert self.scale.dim() == 3 and self.scale.shape[0] == e
        assert self.scale_rows.shape == (n,) and self.scale_cols.shape == (math.ceil(k / GROUP),)


def unsupported(device: torch.device) -> str | None:
    """Why the kernel cannot run on `device` in this process, or None where it can."""
    return triton_mode.unsupported(device, MIN_CAPABILITY, "FP8 tensor cores")
