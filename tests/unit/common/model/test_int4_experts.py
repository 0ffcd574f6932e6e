"""INT4 routed experts on the Triton W4A16 grouped GEMM (the interpreter without CUDA): equal
to dequantize-then-GEMM up to the order of the fp32 sums, with no dequantized copy of the
weights, static and sized, whole and split by experts; a MoE layer with Kimi's INT4 experts
settles on it and answers as the grouped (dequantized) path does."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.language")

from common.model.expert_routing import route
from common.model.experts import grouped_experts
from common.model.experts_kernel import settle
from common.model.fp8 import share_workspace
from common.model.int4 import Int4Weight
from common.model.int4_experts import Int4GroupedExperts
from common.model.moe import MoE, use_experts_kernel
from tests.tiny_families import pack_int4
from tests.unit.common.model.test_moe import EXPERTS

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Of the output's largest magnitude: fp32 sums in another order (bf16: the outputs' roundings
# of those sums, carried through SiLU * up into the down projection).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

pytestmark = pytest.mark.usefixtures("triton_interpret")


def int4_stack(w: torch.Tensor, dtype: torch.dtype, role: str) -> Int4Weight:
    """The experts w [E, R, C] packed as Kimi's checkpoints hold them (group 16 here)."""
    words, scales = zip(*(pack_int4(e, 16)[:2] for e in w), strict=True)
    return Int4Weight(torch.stack(words), torch.stack(scales), 16, dtype, role).to(DEVICE)


def experts(held: int, dtype: torch.dtype) -> tuple[Int4Weight, Int4Weight]:
    g = torch.Generator().manual_seed(held)
    gate_up = int4_stack(torch.randn(held, 2 * 48, 64, generator=g), dtype, "gate_up")
    down = int4_stack(torch.randn(held, 64, 48, generator=g), dtype, "down")
    share_workspace(torch.nn.ModuleDict({"gate_up": gate_up, "down": down}))
    return gate_up, down


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sized", [False, True])
@pytest.mark.parametrize(("held", "first"), [(4, 0), (2, 1)])  # every expert (tp), or EP
def test_int4_experts_equal_dequantize_then_gemm(
    held: int, first: int, sized: bool, dtype: torch.dtype
) -> None:
    gate_up, down = experts(held, dtype)
    kernel, how = settle("triton", gate_up, down)
    assert how == "triton (INT4, groups of 16)" and isinstance(kernel, Int4GroupedExperts)
    whole_up = gate_up.dequantize(out=torch.empty(gate_up.shape, dtype=dtype, device=DEVICE))
    whole_down = down.dequantize(out=torch.empty(down.shape, dtype=dtype, device=DEVICE))
    g = torch.Generator().manual_seed(7)
    for t in (1, 7, 40):
        x = torch.randn(t, 64, generator=g).to(DEVICE, dtype)
        ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(t)]).to(DEVICE)
        weights = torch.rand(t, 2, generator=g).to(DEVICE)
        r = route(ids, weights, held, first, sized=sized)
        got = kernel(x, r, gate_up, down)
        assert got.shape == (t, 64) and got.dtype == dtype
        want = grouped_experts(x, r, whole_up, whole_down).float()
        err = float((got.float() - want).abs().max())
        assert err <= TOLERANCE[dtype] * max(float(want.abs().max()), 1e-6), err
    # No dequantization buffer: the kernel read the words and scales as loaded.
    assert not [key for key in gate_up.workspace._buffers if key[0] in ("gate_up", "down")]


def test_a_moe_layer_with_int4_experts_runs_them_on_the_kernel() -> None:
    moe = MoE(EXPERTS)
    g = torch.Generator().manual_seed(0)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1, generator=g)
    for name in ("gate_up_proj", "down_proj"):  # as the loader places them
        w = getattr(moe.experts, name).detach()
        delattr(moe.experts, name)
        setattr(moe.experts, name, int4_stack(w, torch.float32, name))
    model = torch.nn.ModuleDict({"layer": moe.to(DEVICE)})
    share_workspace(model)
    x = torch.randn(6, EXPERTS.hidden_size, generator=g).to(DEVICE)
    assert use_experts_kernel(model, "grouped") == {
        "layer": f"grouped, dequantized {EXPERTS.n_routed_experts} experts at a time"
    }
    with torch.inference_mode():
        want = moe(x)
        assert use_experts_kernel(model, "triton") == {"layer": "triton (INT4, groups of 16)"}
        got = moe(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
