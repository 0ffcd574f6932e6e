"""The shipped DSA demo (models/demo-dsa, DeepSeek-V3.2's architecture) serves as the README
says (`TPLA_MODEL=models/demo-dsa make serve`): `tpla serve --smoke` answers through its
sparse attention, on its PCA side file, and its decode group leaves prompts to the prefill
worker (its own prefill pass writes no indexer keys)."""

from __future__ import annotations

import json
from pathlib import Path

from tools.local_stack import LocalStack

DEMO_DSA = Path(__file__).resolve().parents[2] / "models" / "demo-dsa"
SMOKE_TIMEOUT_S = 300


def test_the_dsa_demo_serves() -> None:
    config = json.loads((DEMO_DSA / "config.json").read_text())
    assert config["model_type"] == "deepseek_v32" and config["index_topk"] == 64
    stack = LocalStack.launch(DEMO_DSA, "--smoke", KV_BUDGET_MB="8")
    try:
        code = stack.proc.wait(timeout=SMOKE_TIMEOUT_S)
    finally:
        stack.stop()
    log = stack.log()
    assert code == 0 and '"chat.completion"' in log and '"finish_reason"' in log, log[-4000:]
    assert "no TPLA side file" not in log, log[-4000:]
    assert "local prefill off" in log, log[-4000:]
