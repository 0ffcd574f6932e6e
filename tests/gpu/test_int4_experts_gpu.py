"""The Triton W4A16 grouped GEMM on a GPU (run by `pytest -m gpu`; skips without CUDA, or on
a GPU where the Triton experts kernel is not offered): compiled, it equals its reference at
Kimi K2's expert shapes; a MoE layer's INT4 experts on it equal dequantize-then-GEMM, read
nothing back to the host and replay in a CUDA graph; `auto` picks it for the experts.
"""

from __future__ import annotations

import pytest
import torch

from common.model.experts_kernel import select_experts_kernel, settle
from common.model.fp8 import share_workspace
from common.model.int4 import Int4Weight
from common.triton_kernels.int4_grouped_gemm import int4_grouped_mm, int4_grouped_mm_reference
from tests.gpu.test_fp8_experts_gpu import check_graph_replay, run_without_a_sync, why_not

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(why_not() is not None, reason=str(why_not())),
]

CUDA = torch.device("cuda")
GROUP = 32  # Kimi K2-Thinking / K2.5 / K2.6's group_size


def int4_stack(held: int, rows: int, cols: int, role: str, seed: int = 0) -> Int4Weight:
    """Random INT4 experts [held, rows, cols] with bf16 group scales, made on the device."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    words = torch.randint(
        -(2**31), 2**31 - 1, (held, rows, cols // 8), generator=g, device=CUDA, dtype=torch.int32
    )
    scale = (torch.rand(held, rows, cols // GROUP, generator=g, device=CUDA) * 0.02 + 0.005).to(
        torch.bfloat16
    )
    return Int4Weight(words, scale, GROUP, torch.bfloat16, role)


def _layer(held: int, d: int, i: int, batch: int, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    gate_up, down = int4_stack(held, 2 * i, d, "gate_up", seed), int4_stack(held, d, i, "down")
    share_workspace(torch.nn.ModuleDict({"gate_up": gate_up, "down": down}))
    x = torch.randn(batch, d, generator=g).to(CUDA, torch.bfloat16)
    ids = torch.rand(batch, 384, generator=g).topk(8, dim=-1).indices.to(CUDA) % held
    weights = torch.rand(batch, 8, generator=g).to(CUDA)
    return gate_up, down, x, ids, weights


def test_auto_runs_the_int4_experts_on_the_triton_kernel() -> None:
    assert select_experts_kernel("auto", CUDA, torch.bfloat16).kernel == "triton"
    gate_up, down, *_ = _layer(4, 256, 128, batch=1)
    assert settle("triton", gate_up, down)[1] == "triton (INT4, groups of 32)"


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("rows", [1, 40, 700])  # 16-, 64-row tiles; several M splits
def test_the_compiled_kernel_equals_its_reference(rows: int, gather: bool) -> None:
    w = int4_stack(4, 512, 7168, "w", seed=rows)
    g = torch.Generator().manual_seed(rows)
    a = torch.randn(rows, 7168, generator=g).to(CUDA, torch.bfloat16)
    ends = torch.tensor([rows // 4, rows // 2, rows // 2, rows], dtype=torch.int32, device=CUDA)
    idx = torch.randperm(rows, generator=g).int().to(CUDA) if gather else None
    for out_dtype in (torch.bfloat16, torch.float32):
        got = int4_grouped_mm(a, ends, w.packed, w.scale, GROUP, out_dtype, idx).float()
        want = int4_grouped_mm_reference(a, ends, w.packed, w.scale, GROUP, out_dtype, idx)
        # bf16 x bf16 products are exact in the tensor cores' fp32 accumulators: the sums'
        # order (and a bf16 output's rounding) alone.
        tol = 1e-5 if out_dtype == torch.float32 else 8e-3
        assert (got - want.float()).abs().max() <= tol * want.float().abs().max()


@pytest.mark.parametrize(("held", "d", "i"), [(48, 7168, 2048), (384, 7168, 256)])
def test_int4_experts_equal_dequantize_then_gemm_without_a_sync(held: int, d: int, i: int) -> None:
    got, want = run_without_a_sync(_layer(held, d, i, batch=64), "triton (INT4, groups of 32)")
    # Both bf16 GEMM pairs over the same bf16 weights: the sums' order and roundings only.
    assert (got - want).norm() <= 0.02 * want.norm()


def test_int4_experts_replay_in_a_cuda_graph() -> None:
    check_graph_replay(_layer(48, 7168, 2048, batch=16, seed=1))
