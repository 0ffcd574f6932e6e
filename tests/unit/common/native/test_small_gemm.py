"""The native decode-sized products (common/native/small_gemm) against their PyTorch
references, their fallbacks, and a decode rank's FFN on them against `module(x)`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model.expert_routing import route
from common.model.experts import routed_experts
from common.native import small_gemm

pytestmark = pytest.mark.skipif(not small_gemm.available(), reason="native library not built")


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n,k", [(7, 13), (96, 256), (250, 144), (6, 8)])
def test_linear_matches_f_linear(m: int, n: int, k: int) -> None:
    x, w = _randn(m, k, seed=m), _randn(n, k, seed=n + k)
    with torch.inference_mode():
        got = small_gemm.linear(x, w)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_linear_falls_back_where_the_kernel_does_not_apply() -> None:
    w = _randn(32, 16, seed=0)
    # Many rows, a non-contiguous input, another dtype: BLAS, same results as F.linear.
    for x in (_randn(40, 16, seed=1), _randn(16, 4, seed=2).t(), _randn(3, 16, seed=3).double()):
        ww = w.to(x.dtype)
        assert torch.equal(small_gemm.linear(x, ww), F.linear(x, ww))
    # Autograd: the native path has no backward, so a graph-building call stays on torch.
    wg = w.clone().requires_grad_(True)
    y = small_gemm.linear(_randn(2, 16, seed=4), wg)
    assert y.grad_fn is not None
    y.sum().backward()
    assert wg.grad is not None


@pytest.mark.parametrize("m", [1, 2, 5, 8, 9])
def test_mlp_matches_the_module(m: int) -> None:
    from common.model.moe import MLP

    mlp = MLP(40, 24)
    for n, p in enumerate(mlp.parameters()):
        p.data = _randn(*p.shape, seed=n, scale=0.2)
    x = _randn(m, 40, seed=m)
    with torch.inference_mode():
        got = small_gemm.mlp(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
        torch.testing.assert_close(got, mlp(x), rtol=1e-5, atol=1e-6)


def _routing(m: int, k: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(m)])
    return ids, torch.rand(m, k, generator=g)


@pytest.mark.parametrize("m,k", [(1, 1), (1, 2), (3, 2), (16, 2), (64, 3)])
def test_moe_experts_match_the_reference_loop(m: int, k: int) -> None:
    e, i, d = 8, 24, 40
    x = _randn(m, d, seed=m)
    gate_up, down = _randn(e, 2 * i, d, seed=1, scale=0.1), _randn(e, d, i, seed=2, scale=0.1)
    ids, weights = _routing(m, k, e, seed=m + k)
    with torch.inference_mode():
        got = small_gemm.moe_experts(x, ids, weights, gate_up, down)
    want = routed_experts(x, route(ids, weights, e), gate_up, down)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_moe_experts_take_a_token_routed_twice_to_one_expert() -> None:
    """Not a top-k routing, but the reference sums both. The kernel's buffers held M rows
    per expert, so this wrote past them (a heap corruption found by a micro-benchmark; the
    overflow need not crash, so this test checks the sums)."""
    e, i, d = 3, 8, 16
    gate_up, down = _randn(e, 2 * i, d, seed=1, scale=0.1), _randn(e, d, i, seed=2, scale=0.1)
    x = _randn(2, d, seed=3)
    ids, weights = torch.tensor([[1, 1, 1], [0, 1, 1]]), _randn(2, 3, seed=4)
    with torch.inference_mode():
        got = small_gemm.moe_experts(x, ids, weights, gate_up, down)
    want = routed_experts(x, route(ids, weights, e), gate_up, down)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_moe_experts_reject_bad_ids_and_decline_above_the_row_bound() -> None:
    e, i, d = 4, 8, 16
    gate_up, down = _randn(e, 2 * i, d, seed=1), _randn(e, d, i, seed=2)
    x = _randn(2, d, seed=3)
    with pytest.raises(ValueError, match="outside"):
        small_gemm.moe_experts(x, torch.tensor([[0], [4]]), torch.ones(2, 1), gate_up, down)
    m = small_gemm.MAX_MOE_ROWS + 1
    x = _randn(m, d, seed=4)
    ids, weights = _routing(m, 2, e, seed=5)
    assert small_gemm.moe_experts(x, ids, weights, gate_up, down) is None


def test_a_ranks_ffn_slices_run_natively_as_their_modules_do(tmp_path) -> None:
    """The native FFN forward of every layer's slice (dense MLP, MoE with shared experts)
    equals the module's own forward; the native backend runs the native products."""
    from common.loading.loader import load_model
    from common.model.moe import MoE
    from common.parallel import ParallelConfig
    from services.decode.rank.backends.native_backend import NativeBackend
    from services.decode.rank.rank_model import RankModel
    from tests.tiny import save_hf

    save_hf("v2-greedy", tmp_path, std=0.05)
    full = load_model(tmp_path)
    model = RankModel(full, ParallelConfig(tp=2, latent_groups=2), 1, backend=NativeBackend())
    native = model.backend
    kinds = {type(layer.ffn) for layer in model.layers}
    assert MoE in kinds and len(kinds) == 2  # a dense first layer, then MoE layers
    with torch.inference_mode():
        for rows in (1, 5, 16):
            x = _randn(rows, full.config.hidden_size, seed=rows)
            for layer in model.layers:
                torch.testing.assert_close(
                    native.ffn(layer.ffn, x), layer.ffn(x), rtol=1e-5, atol=1e-6
                )
            torch.testing.assert_close(
                native.linear(x, model.lm_head), F.linear(x, model.lm_head), rtol=1e-5, atol=1e-5
            )
