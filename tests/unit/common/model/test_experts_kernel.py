"""The routed experts' kernel: chosen by the kernel rule per device and dtype, then settled
per layer for its weights (FP8 ones on the Triton kernel where it reads their blocks, else
dequantized a bounded group of experts at a time)."""

from __future__ import annotations

import pytest
import torch

from common.model import experts
from common.model.experts import grouped_experts, routed_experts
from common.model.experts_kernel import loop_reason, select_experts_kernel, settle
from common.model.fp8 import Fp8Weight, RowRun
from common.runtime.kernel_choice import KernelUnavailable
from common.triton_kernels import fp8_blocks

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_the_experts_kernel_is_chosen_by_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert select_experts_kernel("auto", CPU, torch.float32).kernel == "grouped"
    assert select_experts_kernel("loop", CPU, torch.float32).kernel == "loop"
    auto = select_experts_kernel("auto", CPU, torch.float64)
    # On the CPU auto never tries the Triton kernel (the interpreter is for tests).
    assert auto.kernel == "loop" and [name for name, _ in auto.passed_over] == ["grouped"]
    assert "grouped cannot run here: grouped_mm does not run torch.float64" in auto.describe()
    with pytest.raises(KernelUnavailable, match=r"TPLA_EXPERTS_KERNEL=grouped: .*float64 on cpu"):
        select_experts_kernel("grouped", CPU, torch.float64)
    # A CUDA-only choice: grouped_mm runs bf16 there, asked for in fp32.
    with pytest.raises(KernelUnavailable, match=r"TPLA_EXPERTS_KERNEL=grouped: .*CUDA runs bf16"):
        select_experts_kernel("grouped", CUDA, torch.float32)
    with pytest.raises(ValueError, match="TPLA_EXPERTS_KERNEL=fast: not one of auto, triton,"):
        select_experts_kernel("fast", CPU, torch.float32)
    with pytest.raises(KernelUnavailable, match=r"TPLA_EXPERTS_KERNEL=triton: .*CUDA"):
        select_experts_kernel("triton", CPU, torch.float32)
    pytest.importorskip("triton.language")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_experts_kernel("triton", CPU, torch.float32).kernel == "triton"
    assert select_experts_kernel("auto", CPU, torch.float32).kernel == "grouped"


def fp8_stack(shape: tuple[int, int, int], col_offset: int = 0) -> Fp8Weight:
    """A stack of experts of one 128 x 128 block scale each (values all 1)."""
    e, rows, cols = shape
    values = torch.ones(shape).to(torch.float8_e4m3fn)
    scale = torch.full((e, -(-rows // 128), -(-(col_offset % 128 + cols) // 128)), 0.5)
    run = (RowRun(rows, 0, 0),)
    return Fp8Weight(values, scale, run, col_offset, (128, 128), shape, torch.float32, "w")


def test_each_layer_settles_what_runs_its_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    dense_up, dense_down = torch.zeros(4, 64, 32), torch.zeros(4, 32, 32)
    assert settle("grouped", dense_up, dense_down) == (grouped_experts, "grouped")
    assert settle("triton", dense_up, dense_down) == (grouped_experts, "grouped")
    kernel, how = settle("loop", dense_up, dense_down)
    assert kernel is routed_experts and how == "loop: the loop was chosen (TPLA_EXPERTS_KERNEL)"
    odd_up, odd_down = torch.zeros(4, 6, 32), torch.zeros(4, 32, 3)  # 12-byte rows
    assert "16 bytes" in (loop_reason("grouped", odd_up, odd_down) or "")
    assert settle("grouped", odd_up, odd_down)[1].startswith("loop: the expert intermediate")

    # FP8 experts without their kernel: grouped, a bounded group of experts at a time.
    gate_up, down = fp8_stack((4, 64, 256)), fp8_stack((4, 256, 32))
    per_expert = (64 * 256 + 256 * 32) * 4
    monkeypatch.setattr(experts, "DEQUANTIZED_BYTES", 3 * per_expert)
    assert settle("grouped", gate_up, down) == (
        grouped_experts,
        "grouped, dequantized 3 experts at a time",
    )
    # Columns from inside a block: the kernel's 128-column groups would straddle two scales.
    kernel, how = settle("triton", gate_up, fp8_stack((4, 256, 32), col_offset=32))
    assert kernel is grouped_experts and "(triton: columns from 32 into a 128-wide" in how
    assert loop_reason("triton", gate_up, down) is None
    kernel, how = settle("triton", gate_up, down)
    assert how == "triton (FP8 blocks)" and type(kernel).__name__ == "Fp8GroupedExperts"


@pytest.mark.parametrize(("capability", "offered"), [((7, 5), False), ((8, 0), True)])
def test_triton_experts_are_offered_from_sm80(
    capability: tuple[int, int], offered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W4A16 needs 16-bit tensor cores only (sm_80); the FP8 kernel needs FP8 ones (sm_89), and
    an FP8 layer on an sm_80 GPU settles to grouped, saying why (`_triton_experts`)."""
    pytest.importorskip("triton.language")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    if offered:
        assert select_experts_kernel("triton", CUDA, torch.bfloat16).kernel == "triton"
    else:
        with pytest.raises(KernelUnavailable, match="16-bit tensor cores need sm_80"):
            select_experts_kernel("triton", CUDA, torch.bfloat16)
    why = fp8_blocks.unsupported(CUDA) or ""
    assert why.startswith(f"sm_{capability[0]}{capability[1]}: FP8 tensor cores need sm_89")
