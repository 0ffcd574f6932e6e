"""The grouped routed-expert kernel against the reference loop, whole and split by experts."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from common.model.args import ModelConfig
from common.model.experts import (
    grouped_experts,
    grouped_unsupported,
    loop_reason,
    routed_experts,
    select_experts_kernel,
)
from common.model.moe import MoE, use_experts_kernel
from common.runtime.kernel_choice import KernelUnavailable

E, D, I, K = 8, 32, 16, 2
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _case(
    t: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, D, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t + 1)])[:t]
    weights = torch.rand(t, K, generator=g)
    gate_up = (torch.randn(E, 2 * I, D, generator=g) / D**0.5).to(dtype)
    down = (torch.randn(E, D, I, generator=g) / I**0.5).to(dtype)
    return x, ids, weights, gate_up, down


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 5, 64])
def test_grouped_equals_the_reference_loop(dtype: torch.dtype, t: int) -> None:
    x, ids, weights, gate_up, down = _case(t, dtype)
    assert grouped_unsupported(gate_up, down) is None
    want = routed_experts(x, ids, weights, gate_up, down)
    got = grouped_experts(x, ids, weights, gate_up, down)
    assert got.dtype == dtype and got.shape == (t, D)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_experts_and_every_token_on_one_expert(dtype: torch.dtype) -> None:
    x, _, weights, gate_up, down = _case(9, dtype, seed=1)
    one = torch.full((9, K), 5)  # the same expert in both slots: every other expert is empty
    torch.testing.assert_close(
        grouped_experts(x, one, weights, gate_up, down).float(),
        routed_experts(x, one, weights, gate_up, down).float(),
        **TOL[dtype],
    )
    edges = torch.tensor([[0, 7]] * 9)  # only the first and the last group hold tokens
    torch.testing.assert_close(
        grouped_experts(x, edges, weights, gate_up, down).float(),
        routed_experts(x, edges, weights, gate_up, down).float(),
        **TOL[dtype],
    )


def test_no_tokens() -> None:
    x, ids, weights, gate_up, down = _case(0, torch.float32)
    assert grouped_experts(x, ids, weights, gate_up, down).shape == (0, D)


@pytest.mark.parametrize("kernel", [routed_experts, grouped_experts])
@pytest.mark.parametrize("cuts", [(0, 4, 8), (0, 3, 6, 8), (0, 1, 8)])
def test_held_experts_sum_to_the_whole_layer(kernel: object, cuts: tuple[int, ...]) -> None:
    """Expert parallelism: each rank runs its run of experts, foreign slots count zero."""
    x, ids, weights, gate_up, down = _case(16, torch.float32, seed=2)
    whole = routed_experts(x, ids, weights, gate_up, down)
    parts = [
        kernel(x, ids, weights, gate_up[a:b], down[a:b], a)  # type: ignore[operator]
        for a, b in itertools.pairwise(cuts)
    ]
    torch.testing.assert_close(sum(parts), whole, atol=1e-5, rtol=1e-5)


def test_misaligned_or_unsupported_weights_fall_back_to_the_loop() -> None:
    _, _, _, gate_up, down = _case(1, torch.float32)
    odd_up, odd_down = torch.zeros(E, 2 * 3, D), torch.zeros(E, D, 3)  # 12-byte rows
    assert "16 bytes" in (grouped_unsupported(odd_up, odd_down) or "")
    assert "16 bytes" in (loop_reason("grouped", odd_up, odd_down) or "")
    assert grouped_unsupported(gate_up.double(), down.double()) is not None
    assert grouped_unsupported(gate_up.transpose(1, 2), down) is not None
    assert loop_reason("grouped", gate_up, down) is None
    assert "loop was chosen" in (loop_reason("loop", gate_up, down) or "")


def test_the_experts_kernel_is_chosen_by_the_rule() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert select_experts_kernel("auto", cpu, torch.float32).kernel == "grouped"
    assert select_experts_kernel("loop", cpu, torch.float32).kernel == "loop"
    auto = select_experts_kernel("auto", cpu, torch.float64)
    assert auto.kernel == "loop" and [name for name, _ in auto.passed_over] == ["grouped"]
    assert "grouped cannot run here: grouped_mm does not run torch.float64" in auto.describe()
    with pytest.raises(KernelUnavailable, match=r"TPLA_EXPERTS_KERNEL=grouped: .*float64 on cpu"):
        select_experts_kernel("grouped", cpu, torch.float64)
    # A CUDA-only choice: grouped_mm runs bf16 there, asked for in fp32.
    with pytest.raises(KernelUnavailable, match=r"TPLA_EXPERTS_KERNEL=grouped: .*CUDA runs bf16"):
        select_experts_kernel("grouped", cuda, torch.float32)
    with pytest.raises(ValueError, match="TPLA_EXPERTS_KERNEL=fast: not one of auto, grouped"):
        select_experts_kernel("fast", cpu, torch.float32)


CFG = ModelConfig(
    model_type="deepseek_v2",
    vocab_size=8,
    hidden_size=D,
    intermediate_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    kv_lora_rank=8,
    qk_nope_head_dim=4,
    qk_rope_head_dim=4,
    v_head_dim=4,
    n_routed_experts=E,
    n_shared_experts=1,
    moe_intermediate_size=I,
    num_experts_per_tok=K,
)


def test_moe_picks_its_kernel_once_and_again_after_a_cast() -> None:
    moe = MoE(CFG)
    torch.nn.init.normal_(moe.gate.weight)
    for p in (moe.experts.gate_up_proj, moe.experts.down_proj):
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(4, D)
    out = moe(x)
    assert moe.kernel is grouped_experts
    moe.double()
    assert moe.kernel is routed_experts  # no float64 grouped_mm: the loop, picked anew
    torch.testing.assert_close(moe(x.double()).float(), out, atol=1e-5, rtol=1e-5)


def test_the_model_runs_the_chosen_experts_kernel() -> None:
    moe = torch.nn.ModuleDict({"layer": MoE(CFG)})
    layer = moe["layer"]
    torch.nn.init.normal_(layer.gate.weight)
    for p in (layer.experts.gate_up_proj, layer.experts.down_proj):
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(4, D)
    grouped = layer(x)
    assert use_experts_kernel(moe, "loop") == {
        "layer": "loop: the loop was chosen (TPLA_EXPERTS_KERNEL)"
    }
    assert layer.kernel is routed_experts
    torch.testing.assert_close(layer(x), grouped, atol=1e-5, rtol=1e-5)
    layer.float()  # a move keeps the choice
    assert layer.kernel is routed_experts
    assert use_experts_kernel(moe, "grouped") == {"layer": "grouped"}
    assert layer.kernel is grouped_experts


def test_a_moe_holding_some_experts_routes_the_rest_elsewhere() -> None:
    whole = MoE(CFG)
    for p in whole.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(6, D)
    weights, ids = whole.gate(x)
    halves = []
    for held in (slice(0, 3), slice(3, E)):
        part = MoE(dataclasses.replace(CFG, n_shared_experts=0), held)
        part.experts.gate_up_proj.data = whole.experts.gate_up_proj.data[held]
        part.experts.down_proj.data = whole.experts.down_proj.data[held]
        assert not part.holds_all and part.first_expert == held.start
        halves.append(part.routed(x, ids, weights))
    torch.testing.assert_close(halves[0] + halves[1], whole.routed(x, ids, weights))
