"""Decode engines for the integration tests: a real rank group (spawned processes) on a small
checkpoint, in each layout at tp = 2 (SP in chunks of 4 tokens), over a small pool of 4-token
blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.parallel import ParallelConfig, ParallelMode
from services.decode.config import EngineConfig
from services.decode.engine import DecodeEngine

TINY_LAYOUTS: dict[str, ParallelConfig] = {
    "tpla": ParallelConfig(tp=2, latent_groups=2),
    "mla-tp": ParallelConfig(tp=2, latent_groups=1),
    "sp": ParallelConfig(tp=2, latent_groups=1, mode=ParallelMode.SP, chunk_size=4),
}


def tiny_engine(
    model_dir: Path | str,
    parallel: ParallelConfig,
    eos_token_ids: tuple[int, ...] | None = None,
    **overrides: Any,
) -> DecodeEngine:
    """A decode group on `model_dir` in `parallel`, its rendezvous on a free port: a 2 MiB pool
    of 4-token blocks unless `overrides` (EngineConfig fields) say otherwise."""
    fields: dict[str, Any] = {"master_port": 0, "kv_budget_mb": 2, "block_size": 4}
    cfg = EngineConfig(model=str(model_dir), parallel=parallel, **{**fields, **overrides})
    return DecodeEngine(cfg, eos_token_ids=eos_token_ids)
