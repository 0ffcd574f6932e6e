"""The grouped routed experts on CUDA in bf16: grouped_mm is picked and equals the loop, with
no host read inside the layer (run by `pytest -m gpu` where CUDA exists)."""

from __future__ import annotations

import pytest
import torch

from common.model.experts import (
    grouped_experts,
    grouped_unsupported,
    routed_experts,
    select_experts_kernel,
)
from tests.unit.common.model.test_experts import TOL, _case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _on_cuda(t: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(v.cuda() for v in _case(t, dtype))


def test_grouped_mm_is_picked_for_bf16_and_not_fp32() -> None:
    *_, gate_up, down = _on_cuda(4, torch.bfloat16)
    assert grouped_unsupported(gate_up, down) is None, torch.__version__
    cuda = gate_up.device
    assert select_experts_kernel("auto", cuda, torch.bfloat16).kernel == "grouped"
    assert select_experts_kernel("auto", cuda, torch.float32).kernel == "loop"
    assert grouped_unsupported(gate_up.float(), down.float()) is not None


@pytest.mark.parametrize("t", [1, 16, 64])
def test_grouped_equals_the_loop_on_cuda_without_a_sync(t: int) -> None:
    x, ids, weights, gate_up, down = _on_cuda(t, torch.bfloat16)
    want = routed_experts(x, ids, weights, gate_up, down)
    grouped_experts(x, ids, weights, gate_up, down)  # first call: kernel selection, autotune
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = grouped_experts(x, ids, weights, gate_up, down)
        held = grouped_experts(x, ids, weights, gate_up[2:5], down[2:5], 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.bfloat16])
    part = routed_experts(x, ids, weights, gate_up[2:5], down[2:5], 2)
    torch.testing.assert_close(held.float(), part.float(), **TOL[torch.bfloat16])
