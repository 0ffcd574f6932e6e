"""The grouped routed experts on CUDA in bf16: bf16 tensors settle on grouped_mm (fp32 ones
on the loop) whichever kernel `auto` chose, and grouped equals the loop with no host read
inside the layer (run by `pytest -m gpu` where CUDA exists)."""

from __future__ import annotations

import pytest
import torch

from common.model.expert_routing import route
from common.model.experts import grouped_experts, grouped_unsupported, routed_experts
from common.model.experts_kernel import select_experts_kernel, settle
from tests.unit.common.model.test_experts import TOL, E, _case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _on_cuda(t: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(v.cuda() for v in _case(t, dtype))


def test_bf16_experts_settle_on_grouped_mm_and_fp32_on_the_loop() -> None:
    *_, gate_up, down = _on_cuda(4, torch.bfloat16)
    assert grouped_unsupported(gate_up, down) is None, torch.__version__
    chosen = select_experts_kernel("auto", gate_up.device, torch.bfloat16).kernel
    assert chosen in ("triton", "grouped")  # triton where it runs: for quantized experts
    assert settle(chosen, gate_up, down)[1] == "grouped"
    fp32 = select_experts_kernel("auto", gate_up.device, torch.float32).kernel
    assert settle(fp32, gate_up.float(), down.float())[1].startswith("loop")


@pytest.mark.parametrize("t", [1, 16, 64])
def test_grouped_equals_the_loop_on_cuda_without_a_sync(t: int) -> None:
    x, ids, weights, gate_up, down = _on_cuda(t, torch.bfloat16)
    whole, held = route(ids, weights, E), route(ids, weights, 3, first=2)
    want = routed_experts(x, whole, gate_up, down)
    grouped_experts(x, whole, gate_up, down)  # first call: any lazy initialization
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = grouped_experts(x, whole, gate_up, down)
        part = grouped_experts(x, held, gate_up[2:5], down[2:5])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.bfloat16])
    expected = routed_experts(x, route(ids, weights, 3, first=2), gate_up[2:5], down[2:5])
    torch.testing.assert_close(part.float(), expected.float(), **TOL[torch.bfloat16])
