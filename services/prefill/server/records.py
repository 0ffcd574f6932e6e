"""A prefill worker's registry record: what routers read of it (its load, its health, the
prompts its latent prefix cache holds); while it loads, a record saying so."""

from __future__ import annotations

import os
from typing import Any

from common.kv.prefix_cache import PUBLISHED_HASHES, format_hashes
from common.runtime.redis_state import WorkerRecord, WorkerRole
from services.prefill.batch.latent_cache import LatentPrefixCache
from services.prefill.config import PrefillGroupConfig
from services.prefill.worker import PrefillWorker


def worker_record(
    worker: PrefillWorker, cfg: PrefillGroupConfig, address: str, draining: bool
) -> WorkerRecord:
    """The record of the worker of `cfg` serving at `address` (one for its whole group)."""
    return WorkerRecord(
        worker_id=cfg.worker_id,
        role=WorkerRole.PREFILL,
        address=address,
        pid=os.getpid(),
        queued_tokens=worker.queued_tokens,
        model=cfg.model,
        draining=draining,
        healthy=worker.runner.failed is None,
        tp=cfg.tp,
        **_published(worker.prefix_cache),
    )


def _published(cache: LatentPrefixCache | None) -> dict[str, Any]:
    """The record's prefix fields: the latent cache's root, block size and most recently used
    block hashes, for KV-aware routing of prefills."""
    if cache is None:
        return {}
    return {
        "prefix_root": f"{cache.root:x}",
        "block_size": cache.block_size,
        "prefix_hashes": format_hashes(cache.recent(PUBLISHED_HASHES)),
    }


def loading_record(cfg: PrefillGroupConfig, address: str, loading: str) -> WorkerRecord:
    """The worker's record while it (its group) loads: not healthy (no router sends it
    prompts), saying how far each rank is; its first heartbeat serving replaces it."""
    return WorkerRecord(
        worker_id=cfg.worker_id,
        role=WorkerRole.PREFILL,
        address=address,
        pid=os.getpid(),
        model=cfg.model,
        healthy=False,
        loading=loading,
        tp=cfg.tp,
    )
