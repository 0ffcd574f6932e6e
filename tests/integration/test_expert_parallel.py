"""Expert parallelism in a real tp=2 decode group: greedy tokens equal the column split's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli import ROOT, generate_ids
from tests.tiny import save_hf

PROMPT = ("--prompt-ids", "5,9,33,70,12,3", "--max-tokens", "10", "--ignore-eos")


def _greedy(model: Path, moe: str, kernel: str = "auto") -> list[int]:
    return generate_ids(
        "--model",
        str(model),
        *PROMPT,
        "--tp",
        "2",
        "--parallel",
        "mla-tp",
        env={"TPLA_MOE_PARALLEL": moe, "TPLA_DECODE_KERNEL": kernel},
    )


def test_demo_model_ep_equals_tp() -> None:
    demo = ROOT / "models" / "demo"
    if not (demo / "model.safetensors").exists():
        pytest.skip("models/demo has no weights here")
    assert _greedy(demo, "ep") == _greedy(demo, "tp")


def test_v3_noaux_tc_ep_equals_tp(tmp_path: Path) -> None:
    save_hf("v3-noaux-yarn", tmp_path, std=0.08)
    want = _greedy(tmp_path, "tp")
    assert len(want) == 10
    assert _greedy(tmp_path, "ep") == want  # the native experts kernel on held experts
    assert _greedy(tmp_path, "ep", "torch") == want  # the grouped kernel
