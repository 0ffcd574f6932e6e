"""Device placement: `auto`, explicit devices, and a clear error for a missing GPU."""

from __future__ import annotations

import pytest
import torch

from common.parallel import ParallelConfig
from common.runtime.device import DeviceError, rank_device, resolve_device
from services.decode.config import EngineConfig
from services.decode.engine import DecodeEngine

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


def test_auto_and_cpu_resolve_here() -> None:
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"
    assert rank_device("cpu", 3) == torch.device("cpu")


@pytest.mark.parametrize("name", ["tpu", "mps", "not a device"])
def test_unknown_devices_are_refused(name: str) -> None:
    with pytest.raises(DeviceError, match="auto, cpu, cuda"):
        resolve_device(name)


@no_cuda
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_asking_for_cuda_without_a_gpu_is_an_error(name: str) -> None:
    with pytest.raises(DeviceError, match="no visible CUDA device"):
        resolve_device(name)
    with pytest.raises(DeviceError, match="CUDA"):
        rank_device(name, 0)


@no_cuda
def test_a_decode_group_on_cuda_fails_before_starting_a_rank(tmp_path) -> None:
    cfg = EngineConfig(model=str(tmp_path), parallel=ParallelConfig(tp=2), device="cuda")
    with pytest.raises(DeviceError, match="CUDA"):
        DecodeEngine(cfg)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_a_group_needs_one_gpu_per_rank() -> None:
    count = torch.cuda.device_count()
    assert rank_device("cuda", count - 1) == torch.device("cuda", count - 1)
    with pytest.raises(DeviceError, match="one GPU per rank"):
        rank_device("cuda", count)
