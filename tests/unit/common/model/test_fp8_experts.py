"""FP8 routed experts on the Triton block-scaled grouped GEMM (the interpreter without CUDA):
equal to dequantize-then-GEMM within the stated tolerance, with no dequantized copy of the
weights, static and sized, whole and split by experts; the blocks it reads and why it
declines others.

Stated tolerance: the relative Frobenius error against the experts dequantized and run by
the grouped GEMMs in fp32 (dequantize-then-GEMM) is at most 6% (both activations, x and the
SiLU * up product, keep 3 mantissa bits, as under scaled_mm: 3.8-4.5% here); against the
same arithmetic in fp32 torch (`emulated`: the activations quantized alike, the weights
dequantized exactly), the kernel's own error, at most 1e-3 of the output's largest
magnitude (1e-7 where the fp32 sums in another order leave every quantized intermediate
alike; 1e-5 where one lands across an e4m3 rounding step).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.language")

from common.loading.weights import CheckpointWeights
from common.model.expert_routing import Routing, combine, route
from common.model.experts import grouped_experts
from common.model.experts_kernel import settle
from common.model.fp8 import Fp8Weight, share_workspace
from common.model.fp8_experts import Fp8GroupedExperts
from common.model.fp8_gemm import quantize_groups
from common.triton_kernels.fp8_blocks import BlockFp8
from common.triton_kernels.fp8_grouped_gemm import dequantized
from tests.shard_checkpoints import FP8_CONFIG, quantize, random_state, save_checkpoint

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VERSUS_DEQUANTIZED = 0.06  # relative Frobenius norm
VERSUS_EMULATED = 1e-3  # of the output's largest magnitude

pytestmark = pytest.mark.usefixtures("triton_interpret")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointWeights:
    fp8, _ = quantize(random_state())
    path = save_checkpoint(fp8, tmp_path_factory.mktemp("fp8"), quantization_config=FP8_CONFIG)
    return CheckpointWeights(path, torch.float32, keep_fp8=True)


def experts(src: CheckpointWeights, cols: slice, held: slice) -> tuple[Fp8Weight, Fp8Weight]:
    """Layer 1's experts `held` (of 4; hidden 192, intermediate 192), columns `cols`."""
    prefix = "model.layers.1.mlp.experts"
    gate_up, down = src.gate_up(prefix, cols, held), src.down(prefix, cols, held)
    assert isinstance(gate_up, Fp8Weight) and isinstance(down, Fp8Weight)
    share_workspace(torch.nn.ModuleDict({"gate_up": gate_up.to(DEVICE), "down": down.to(DEVICE)}))
    return gate_up, down


def emulated(x: torch.Tensor, r: Routing, gate_up: BlockFp8, down: BlockFp8) -> torch.Tensor:
    """The kernel's arithmetic in fp32 torch: both activations quantized as it does, the
    weights dequantized exactly, one matmul per expert."""

    def through(a: torch.Tensor, w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        values, scale = quantize_groups(a)
        k = a.shape[1]
        dq = (values.float() * scale.repeat_interleave(128, dim=1)[:, :k])[rows]
        out = torch.zeros(rows.shape[0], w.shape[1], device=a.device)
        bounds = r.host_bounds()
        for e in range(w.shape[0]):
            out[bounds[e] : bounds[e + 1]] = dq[bounds[e] : bounds[e + 1]] @ w[e].t()
        return out

    gu = through(x, dequantized(gate_up), r.token)
    gate, up = gu.chunk(2, dim=-1)
    h = torch.nn.functional.silu(gate) * up * r.weight[:, None]
    return combine(r, through(h, dequantized(down), torch.arange(r.rows, device=x.device)))


def routing(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 192, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(t)])
    return x.to(DEVICE), ids.to(DEVICE), torch.rand(t, 2, generator=g).to(DEVICE)


@pytest.mark.parametrize("sized", [False, True])
@pytest.mark.parametrize("held", [slice(0, 4), slice(1, 3)])  # every expert (tp), or EP
@pytest.mark.parametrize("cols", [slice(0, 192), slice(0, 96)])  # whole, a tp = 2 rank
def test_fp8_experts_equal_dequantize_then_gemm(
    checkpoint: CheckpointWeights, cols: slice, held: slice, sized: bool
) -> None:
    gate_up, down = experts(checkpoint, cols, held)
    kernel, how = settle("triton", gate_up, down)
    assert how == "triton (FP8 blocks)" and isinstance(kernel, Fp8GroupedExperts)
    whole_up = gate_up.dequantize(out=torch.empty(gate_up.shape, device=DEVICE))
    whole_down = down.dequantize(out=torch.empty(down.shape, device=DEVICE))
    for t in (1, 7, 40):
        x, ids, weights = routing(t, seed=t)
        r = route(ids, weights, held.stop - held.start, held.start, sized=sized)
        got = kernel(x, r, gate_up, down)
        assert got.shape == (t, 192) and got.dtype == torch.float32
        want = grouped_experts(x, r, whole_up, whole_down)
        err = float((got - want).norm() / want.norm().clamp(min=1e-30))  # 0 / 0: none held
        assert err <= VERSUS_DEQUANTIZED, err
        exact = emulated(x, r, kernel.gate_up, kernel.down)
        assert float((got - exact).abs().max()) <= VERSUS_EMULATED * float(exact.abs().max())
    # No dequantization buffer: the kernel read the values and scales as loaded.
    assert not [key for key in gate_up.workspace._buffers if key[0] in (gate_up.role, down.role)]


def test_the_blocks_it_reads_and_why_it_declines(checkpoint: CheckpointWeights) -> None:
    gate_up, down = experts(checkpoint, slice(96, 192), slice(0, 4))  # a tp = 2 rank 1
    blocks = gate_up.block_fp8()
    assert isinstance(blocks, BlockFp8)
    # Gate rows 96..191 then up rows 96..191 of 192: their blocks are stored rows 0, 1, 0, 1.
    assert blocks.scale_rows.tolist() == [0] * 32 + [1] * 64 + [2] * 32 + [3] * 64
    why = down.block_fp8()  # its columns start at 96, inside a 128-column block
    assert isinstance(why, str) and "straddle" in why
    kernel, how = settle("triton", gate_up, down)
    assert kernel is grouped_experts
    assert how.startswith("grouped, dequantized 4 experts at a time (triton: columns from 96")
