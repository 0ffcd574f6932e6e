"""The Triton FP8 block-scaled grouped GEMM on a GPU (run by `pytest -m gpu`; skips without
CUDA, or on a GPU without FP8 tensor cores): compiled, it equals its reference; a MoE layer's
FP8 experts on it equal dequantize-then-GEMM within the unit tests' tolerance, read nothing
back to the host and replay in a CUDA graph; an FP8 linear on it (TPLA_FP8_GEMM=triton)
equals dequantize-on-use within scaled_mm's tolerance; `auto` picks it for the experts.
"""

from __future__ import annotations

import pytest
import torch

from common.model.expert_routing import route
from common.model.experts import grouped_experts
from common.model.experts_kernel import select_experts_kernel, settle
from common.model.fp8 import dense, share_workspace
from common.model.fp8_gemm import assign_gemms
from common.triton_kernels.fp8_blocks import unsupported
from common.triton_kernels.fp8_grouped_gemm import fp8_grouped_mm, fp8_grouped_mm_reference
from tools.bench.moe_fp8_gpu import fp8_stack


def why_not() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    return unsupported(torch.device("cuda"))


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(why_not() is not None, reason=str(why_not())),
]

CUDA = torch.device("cuda")


def _layer(held: int, d: int, i: int, batch: int, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    gate_up = fp8_stack(held, 2 * i, d, CUDA, "gate_up")
    down = fp8_stack(held, d, i, CUDA, "down")
    share_workspace(torch.nn.ModuleDict({"gate_up": gate_up, "down": down}))
    x = torch.randn(batch, d, generator=g).to(CUDA, torch.bfloat16)
    ids = torch.rand(batch, 256, generator=g).topk(8, dim=-1).indices.to(CUDA)
    weights = torch.rand(batch, 8, generator=g).to(CUDA)
    return gate_up, down, x, ids, weights


def test_auto_runs_the_fp8_experts_on_the_triton_kernel() -> None:
    assert select_experts_kernel("auto", CUDA, torch.bfloat16).kernel == "triton"


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("rows", [1, 40, 700])  # 16-, 64-row tiles; several M splits
def test_the_compiled_kernel_equals_its_reference(rows: int, gather: bool) -> None:
    from common.model.fp8_gemm import quantize_groups

    w = fp8_stack(4, 512, 7168, CUDA, "w").block_fp8()
    g = torch.Generator().manual_seed(rows)
    a, a_scale = quantize_groups(torch.randn(rows, 7168, generator=g).to(CUDA))
    ends = torch.tensor([rows // 4, rows // 2, rows // 2, rows], dtype=torch.int32, device=CUDA)
    idx = torch.randperm(rows, generator=g).int().to(CUDA) if gather else None
    for dtype in (torch.bfloat16, torch.float32):
        got = fp8_grouped_mm(a, a_scale, ends, w, dtype, idx).float()
        want = fp8_grouped_mm_reference(a, a_scale, ends, w, dtype, idx).float()
        # fp32 sums in another order; wgmma / mma accumulate each 128-column block's e4m3
        # products with fewer bits than fp32 (DeepSeek-V3's report: about 14), promoted
        # every block, as here.
        assert (got - want).abs().max() <= 1e-2 * want.abs().max()


def run_without_a_sync(layer: tuple, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's experts on the kernel `settle` gives them (said as `how`), once compiled,
    under sync-debug "error", and dequantize-then-GEMM's answer, both in fp32."""
    gate_up, down, x, ids, weights = layer
    held = gate_up.shape[0]
    kernel, settled = settle("triton", gate_up, down)
    assert settled == how
    r = route(ids, weights, held)
    with torch.inference_mode():
        want = grouped_experts(x, r, dense(gate_up), dense(down)).float()
        kernel(x, r, gate_up, down)  # compiles
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = kernel(x, route(ids, weights, held), gate_up, down).float()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return got, want


def check_graph_replay(layer: tuple) -> None:
    """The layer's experts on the Triton kernel, captured in a CUDA graph, replay as eager."""
    gate_up, down, x, ids, weights = layer
    held = gate_up.shape[0]
    kernel, _ = settle("triton", gate_up, down)
    with torch.inference_mode():
        eager = kernel(x, route(ids, weights, held), gate_up, down)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            kernel(x, route(ids, weights, held), gate_up, down)  # warm-up on the side stream
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = kernel(x, route(ids, weights, held), gate_up, down)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.parametrize(("held", "d", "i"), [(32, 7168, 2048), (256, 7168, 256)])
def test_fp8_experts_equal_dequantize_then_gemm_without_a_sync(held: int, d: int, i: int) -> None:
    got, want = run_without_a_sync(_layer(held, d, i, batch=64), "triton (FP8 blocks)")
    assert (got - want).norm() <= 0.06 * want.norm()


def test_fp8_experts_replay_in_a_cuda_graph() -> None:
    check_graph_replay(_layer(32, 7168, 2048, batch=16, seed=1))


def test_an_fp8_linear_on_the_triton_kernel() -> None:
    w = fp8_stack(1, 4096, 7168, CUDA, "w")
    from common.model.fp8 import Fp8Weight

    linear = Fp8Weight(
        w.values[0], w.scale[0], w.rows, 0, (128, 128), (4096, 7168), torch.bfloat16, "lin"
    )
    model = torch.nn.ModuleDict({"w": linear})
    assert assign_gemms(model, "triton") == {"w": "triton"}
    x = torch.randn(5, 7168, device=CUDA, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = linear(x).float()
        want = torch.nn.functional.linear(x, dense(linear)).float()
    assert (got - want).norm() <= 0.05 * want.norm()
