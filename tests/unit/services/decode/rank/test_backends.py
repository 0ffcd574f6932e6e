"""The decode attention backend's selector (TPLA_DECODE_KERNEL) under the kernel-choice rule:
a named backend that cannot run here stops the start-up naming the setting, `auto` takes the
device's kernel where it runs, else the torch reference, and says why."""

from __future__ import annotations

import pytest
import torch

from common.native import latent_attention
from common.runtime.kernel_choice import KernelUnavailable
from services.decode.rank.backends import TorchBackend, decode_backend, select_decode_kernel
from services.decode.rank.backends.triton_backend import TritonBackend

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_cuda_only_and_cpu_only_kernels_asked_for_where_they_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(KernelUnavailable, match=r"^TPLA_DECODE_KERNEL=triton: "):
        select_decode_kernel("triton", CPU, torch.float32)
    with pytest.raises(KernelUnavailable, match=r"^TPLA_DECODE_KERNEL=native: .*fp32 on the CPU"):
        select_decode_kernel("native", CUDA, torch.bfloat16)
    with pytest.raises(KernelUnavailable, match=r"^TPLA_DECODE_KERNEL=native: .*bfloat16"):
        select_decode_kernel("native", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match=r"^TPLA_DECODE_KERNEL=cuda: not one of auto, torch"):
        select_decode_kernel("cuda", CPU, torch.float32)


def test_auto_picks_the_devices_kernel_where_it_runs_else_torch() -> None:
    bf16 = select_decode_kernel("auto", CPU, torch.bfloat16)
    assert bf16.kernel == "torch" and [name for name, _ in bf16.passed_over] == ["native"]
    fp32 = select_decode_kernel("auto", CPU, torch.float32)
    assert fp32.kernel == ("native" if latent_attention.available() else "torch")
    # On CUDA the candidate is Triton, never the CPU's native kernels.
    cuda = select_decode_kernel("auto", CUDA, torch.bfloat16)
    want = "triton" if TritonBackend.unsupported(CUDA, torch.bfloat16) is None else "torch"
    assert cuda.kernel == want and all(name == "triton" for name, _ in cuda.passed_over)
    assert isinstance(
        decode_backend(select_decode_kernel("torch", CPU, torch.float64).kernel), TorchBackend
    )
