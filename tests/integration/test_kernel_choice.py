"""A kernel named by its setting that cannot run on this machine stops `tpla decode` and
`tpla prefill` while they start (exit 2, the setting and the reason on stderr), before any
weight loads; CUDA-only kernels asked for on the CPU show it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from common.runtime.ports import SERVICE_PORT_OFFSETS, free_port, kv_port_offsets
from tests.cli import run_tpla
from tests.tiny import save_hf

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="asks CUDA kernels of a CPU")

TRITON_WHY = "on CUDA devices" if importlib.util.find_spec("triton") else "triton is not installed"
GROUPED_WHY = (
    "does not run torch.float16 on cpu"
    if hasattr(torch.nn.functional, "grouped_mm")
    else "has no torch.nn.functional.grouped_mm"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kernel-model")
    save_hf("v2-greedy", path, std=0.05)
    return path


def _start(service: str, model_dir: Path, settings: dict[str, str]) -> str:
    """`tpla SERVICE` on the CPU, one rank, with `settings` over the defaults: its stderr,
    once it exited 2."""
    env = {
        "TPLA_MODEL": str(model_dir),
        "TPLA_DEVICE": "cpu",
        "TPLA_TP": "1",
        "TPLA_LATENT_GROUPS": "1",
        "TPLA_REPARAM": "",
        "TPLA_KV_PORT_BASE": str(free_port(kv_port_offsets(1))),
        "TPLA_DIST_PORT": str(free_port()),
        "TRITON_INTERPRET": "0",
        **settings,
    }
    port = str(free_port(SERVICE_PORT_OFFSETS))
    proc = run_tpla(service, "--port", port, env=env)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    return proc.stderr


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"TPLA_DECODE_KERNEL": "triton"}, f"TPLA_DECODE_KERNEL=triton: .*{TRITON_WHY}"),
        # grouped_mm runs fp32 and bf16 on the CPU, not fp16.
        (
            {"TPLA_EXPERTS_KERNEL": "grouped", "TPLA_DTYPE": "float16"},
            f"TPLA_EXPERTS_KERNEL=grouped: .*{GROUPED_WHY}",
        ),
    ],
    ids=["decode-attention", "experts"],
)
def test_tpla_decode_stops_on_a_kernel_that_cannot_run(
    model_dir: Path, settings: dict[str, str], error: str
) -> None:
    stderr = _start("decode", model_dir, settings)
    assert re.search(f"tpla decode: error: {error}", stderr), stderr


def test_tpla_prefill_stops_on_a_kernel_that_cannot_run(model_dir: Path) -> None:
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed here")
    stderr = _start("prefill", model_dir, {"TPLA_ATTENTION_BACKEND": "flash-attn"})
    assert (
        "tpla prefill: error: TPLA_ATTENTION_BACKEND=flash-attn: the flash_attn package is "
        "not installed" in stderr
    ), stderr
    stderr = _start("prefill", model_dir, {"TPLA_FP8_GEMM": "scaled_mm"})
    assert "tpla prefill: error: TPLA_FP8_GEMM=scaled_mm: cpu device" in stderr, stderr
