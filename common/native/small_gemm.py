"""Decode-sized products (small_gemm.cpp): a linear layer over a few rows, a dense MLP, and a
MoE layer's routed experts for a few tokens, behind checked calls that fall back to PyTorch.

`linear` is `F.linear` (no bias), `mlp` is `MLP.forward` and `moe_experts` is the expert loop
of `MoE.forward`; all run natively only where the kernel wins and is safe: fp32 contiguous
CPU tensors, no autograd, few rows (BLAS is as fast from ~16 rows of a linear up:
benchmarks/decode_step.md). Anything else takes the PyTorch path: `linear` and `mlp` run
it themselves; `moe_experts` returns None and its caller runs the model's expert loop, whose
module this package does not import.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from common.native.library import load_optional

# Rows up to which the native linear beats BLAS (benchmarks/decode_step.md, "native
# decode-sized linears"). A MoE layer's experts each see ~rows * k / E of its rows, so its
# bound is higher.
MAX_LINEAR_ROWS = 8
MAX_MOE_ROWS = 64

_p = ctypes.c_void_p
_i = ctypes.c_int64


@functools.cache
def _library() -> ctypes.CDLL | None:
    return load_optional(
        "small_gemm",
        {
            "tpla_linear": [_p, _p, _p, _i, _i, _i],
            "tpla_moe_experts": [_p, _p, _p, _p, _p, _p, _i, _i, _i, _i, _i],
            "tpla_mlp": [_p, _p, _p, _p, _p, _i, _i, _i],
        },
        "native decode matmuls",
    )


def available() -> bool:
    """True if the library is built (building it now if needed) and loads here."""
    return _library() is not None


def _native(*tensors: Tensor) -> bool:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return all(t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def linear(x: Tensor, w: Tensor) -> Tensor:
    """`F.linear(x, w)` for x [M, K], w [N, K]; native for M <= MAX_LINEAR_ROWS."""
    if (
        x.dim() == 2
        and w.dim() == 2
        and 0 < x.shape[0] <= MAX_LINEAR_ROWS
        and x.shape[1] == w.shape[1]
        and _native(x, w)
        and (lib := _library()) is not None
    ):
        m, k = x.shape
        n = w.shape[0]
        y = torch.empty(m, n)
        lib.tpla_linear(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, n, k)
        return y
    return F.linear(x, w)


def mlp(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """`MLP.forward`: down (silu(gate x) * up x) for x [M, D], gate / up [I, D], down [D, I];
    natively in one call for M <= MAX_LINEAR_ROWS."""
    m, d = x.shape
    i = gate.shape[0]
    if (
        0 < m <= MAX_LINEAR_ROWS
        and gate.shape == (i, d)
        and up.shape == (i, d)
        and down.shape == (d, i)
        and _native(x, gate, up, down)
        and (lib := _library()) is not None
    ):
        out = torch.empty(m, d)
        lib.tpla_mlp(
            x.data_ptr(), gate.data_ptr(), up.data_ptr(), down.data_ptr(), out.data_ptr(), m, i, d
        )
        return out
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def moe_experts(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor
) -> Tensor | None:
    """`routed_experts` (common/model/moe.py, the expert loop of `MoE.forward`), natively for up
    to MAX_MOE_ROWS fp32 tokens; None where the kernel does not apply and the caller runs the
    reference (which lives with the model: this package never imports the model)."""
    m, d = x.shape
    e, two_i, _ = gate_up.shape
    if (
        0 < m <= MAX_MOE_ROWS
        and ids.shape == weights.shape
        and ids.shape[0] == m
        and ids.dtype == torch.int64
        and ids.is_cpu
        and gate_up.shape[2] == d
        and down.shape == (e, d, two_i // 2)
        and _native(x, weights, gate_up, down)
        and (lib := _library()) is not None
    ):
        ids = ids.contiguous()
        out = torch.empty(m, d)
        status = lib.tpla_moe_experts(
            x.data_ptr(),
            ids.data_ptr(),
            weights.data_ptr(),
            gate_up.data_ptr(),
            down.data_ptr(),
            out.data_ptr(),
            m,
            ids.shape[1],
            e,
            two_i // 2,
            d,
        )
        if status:
            raise ValueError(f"moe_experts: an expert id is outside [0, {e})")
        return out
    return None
