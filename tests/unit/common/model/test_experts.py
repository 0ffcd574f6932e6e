"""The grouped routed-expert kernel against the reference loop, whole and split by experts,
static and sized; FP8 experts dequantized a bounded group at a time equal them dequantized
whole."""

from __future__ import annotations

import itertools

import pytest
import torch

from common.loading.weights import CheckpointWeights
from common.model import experts
from common.model.args import ModelConfig
from common.model.expert_routing import route
from common.model.experts import (
    experts_per_group,
    grouped_experts,
    grouped_unsupported,
    routed_experts,
)
from common.model.fp8 import Fp8Weight, share_workspace
from tests.shard_checkpoints import FP8_CONFIG, quantize, random_state, save_checkpoint

E, D, I, K = 8, 32, 16, 2
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# A MoE layer of these sizes (tests/unit/services/decode/rank/test_graphs.py builds one).
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


@pytest.mark.parametrize("sized", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 5, 64])
def test_grouped_equals_the_reference_loop(dtype: torch.dtype, t: int, sized: bool) -> None:
    x, ids, weights, gate_up, down = _case(t, dtype)
    assert grouped_unsupported(gate_up, down) is None
    want = routed_experts(x, route(ids, weights, E), gate_up, down)
    got = grouped_experts(x, route(ids, weights, E, sized=sized), gate_up, down)
    assert got.dtype == dtype and got.shape == (t, D)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_experts_and_every_token_on_one_expert(dtype: torch.dtype) -> None:
    x, _, weights, gate_up, down = _case(9, dtype, seed=1)
    one = torch.full((9, K), 5)  # the same expert in both slots: every other expert is empty
    edges = torch.tensor([[0, 7]] * 9)  # only the first and the last group hold tokens
    for ids in (one, edges):
        torch.testing.assert_close(
            grouped_experts(x, route(ids, weights, E), gate_up, down).float(),
            routed_experts(x, route(ids, weights, E), gate_up, down).float(),
            **TOL[dtype],
        )


@pytest.mark.parametrize("sized", [False, True])
def test_no_tokens(sized: bool) -> None:
    x, ids, weights, gate_up, down = _case(0, torch.float32)
    assert grouped_experts(x, route(ids, weights, E, sized=sized), gate_up, down).shape == (0, D)


@pytest.mark.parametrize("sized", [False, True])
@pytest.mark.parametrize("kernel", [routed_experts, grouped_experts])
@pytest.mark.parametrize("cuts", [(0, 4, 8), (0, 3, 6, 8), (0, 1, 8)])
def test_held_experts_sum_to_the_whole_layer(
    kernel: object, cuts: tuple[int, ...], sized: bool
) -> None:
    """Expert parallelism: each rank runs its run of experts, foreign slots count zero."""
    x, ids, weights, gate_up, down = _case(16, torch.float32, seed=2)
    whole = routed_experts(x, route(ids, weights, E), gate_up, down)
    parts = []
    for a, b in itertools.pairwise(cuts):
        r = route(ids, weights, b - a, a, sized=sized)
        if sized:  # only the held slots have rows
            assert r.rows == int(((ids >= a) & (ids < b)).sum())
        parts.append(kernel(x, r, gate_up[a:b], down[a:b]))  # type: ignore[operator]
    torch.testing.assert_close(sum(parts), whole, atol=1e-5, rtol=1e-5)


def test_misaligned_or_unsupported_weights_are_named() -> None:
    _, _, _, gate_up, down = _case(1, torch.float32)
    odd_up, odd_down = torch.zeros(E, 2 * 3, D), torch.zeros(E, D, 3)  # 12-byte rows
    assert "16 bytes" in (grouped_unsupported(odd_up, odd_down) or "")
    assert grouped_unsupported(gate_up.double(), down.double()) is not None
    assert grouped_unsupported(gate_up.transpose(1, 2), down) is not None
    assert grouped_unsupported(gate_up, down) is None


@pytest.fixture(scope="module")
def fp8_experts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Fp8Weight, Fp8Weight]:
    """A layer's 4 FP8 experts as a tp = 2 rank holds them (columns 96..192 of 192: rows
    from inside a block, gate then up), from a block-FP8 checkpoint."""
    fp8, _ = quantize(random_state())
    path = save_checkpoint(fp8, tmp_path_factory.mktemp("fp8"), quantization_config=FP8_CONFIG)
    src = CheckpointWeights(path, torch.float32, keep_fp8=True)
    prefix, cols = "model.layers.1.mlp.experts", slice(96, 192)
    gate_up, down = src.gate_up(prefix, cols), src.down(prefix, cols)
    assert isinstance(gate_up, Fp8Weight) and isinstance(down, Fp8Weight)
    return gate_up, down


@pytest.mark.parametrize("sized", [False, True])
@pytest.mark.parametrize("per_group_bytes", [1, 2, 3])  # in experts: 4 groups, 2, then 3 + 1
def test_fp8_experts_in_bounded_groups_equal_them_dequantized_whole(
    fp8_experts: tuple[Fp8Weight, Fp8Weight],
    monkeypatch: pytest.MonkeyPatch,
    per_group_bytes: int,
    sized: bool,
) -> None:
    gate_up, down = fp8_experts
    workspace = share_workspace(torch.nn.ModuleDict({"gate_up": gate_up, "down": down}))
    held, two_i, d = gate_up.shape
    whole_up = gate_up.dequantize(out=torch.empty(gate_up.shape))
    whole_down = down.dequantize(out=torch.empty(down.shape))
    expert_bytes = (two_i * d + down.shape[1] * down.shape[2]) * 4
    monkeypatch.setattr(experts, "DEQUANTIZED_BYTES", per_group_bytes * expert_bytes)
    assert experts_per_group(gate_up, down) == per_group_bytes
    g = torch.Generator().manual_seed(3)
    for t in (1, 3, 17):
        x = torch.randn(t, d, generator=g)
        ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(t)])  # 2 elsewhere
        weights = torch.rand(t, 2, generator=g)
        for kernel in (grouped_experts, routed_experts):
            want = kernel(x, route(ids, weights, held, sized=sized), whole_up, whole_down)
            got = kernel(x, route(ids, weights, held, sized=sized), gate_up, down)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The buffers hold one group of experts, never the layer's.
    buffers = [b for key, b in workspace._buffers.items() if key[0] == gate_up.role]
    assert {b.shape[0] for b in buffers} == {per_group_bytes, 1}  # the loop's: one expert
