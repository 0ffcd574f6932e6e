"""The test stack: `tpla serve` (tools/local_stack.py) on a tiny model with small pools.

Shared by the end-to-end and the fault-injection tests."""

from __future__ import annotations

from pathlib import Path

from tools.local_stack import LocalStack

MODEL_NAME = "tiny-e2e"


def start_stack(model_dir: Path, transport: str, **settings: str) -> LocalStack:
    """The tiny model's stack: TPLA tp=2 r=2, no side file, 8 MiB KV per rank, fast
    heartbeats; `settings` (TPLA_<KEY> values) override any of it."""
    defaults = {
        "SERVED_MODEL_NAME": MODEL_NAME,
        "REPARAM": "",
        "TP": "2",
        "LATENT_GROUPS": "2",
        "TRANSPORT": transport,
        "KV_BUDGET_MB": "8",
        "HEARTBEAT_S": "0.5",
    }
    return LocalStack.start(model_dir, **{**defaults, **settings})
