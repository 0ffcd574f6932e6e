"""The decode group's registry records: one per rank process, published by the leader; while
the group loads, one record of the leader saying so."""

from __future__ import annotations

import os

from common.kv.prefix_cache import PUBLISHED_HASHES, format_hashes
from common.runtime.redis_state import WorkerRecord, WorkerRole
from services.decode.config import EngineConfig
from services.decode.engine import DecodeEngine
from services.decode.stream import EngineError

# A decode step this long means a rank hangs (a step takes milliseconds to a second): the
# group reports unhealthy so routers stop sending it work while its collective times out.
STALLED_STEP_S = 10.0


def rank_records(
    engine: DecodeEngine, address: str, group_id: str, model: str
) -> list[WorkerRecord]:
    """One registry record per rank process of the group (the leader reports for all)."""
    stalled = engine.step_running_for() >= STALLED_STEP_S
    try:
        # Bounded: a loop stuck in a collective must not stop the heartbeat that reports it.
        load = engine.load(timeout=1.0)
        used, total, cached = load.blocks_used, load.blocks_total, load.blocks_cached
        hashes = engine.cached_hashes(PUBLISHED_HASHES, 1.0) if engine.cfg.prefix_cache else []
    except EngineError:
        # A loop inside a long step (a big batch on the CPU) answers late but is not stalled
        # until STALLED_STEP_S: report its last load. A loop that never answered, or failed,
        # is not healthy.
        last = engine.last_load
        if last is None or engine.failed is not None:
            used, total, cached, stalled = 0, engine.pool.num_blocks, 0, True
        else:
            used, total, cached = last.blocks_used, last.blocks_total, last.blocks_cached
        hashes = []
    par = engine.cfg.parallel
    pids = [os.getpid(), *engine.follower_pids]
    alive = engine.follower_alive()
    return [
        WorkerRecord(
            worker_id=f"{group_id}/rank{rank}",
            role=WorkerRole.DECODE,
            address=address,
            rank=rank,
            pid=pid,
            group_id=group_id,
            healthy=ok and engine.failed is None and not stalled,
            draining=engine.draining,
            kv_blocks_used=used,
            kv_blocks_total=total,
            tp=par.tp,
            latent_groups=par.latent_groups,
            parallel=par.name,
            model=model,
            kv_blocks_cached=cached,
            block_size=engine.cfg.block_size,
            # The leader's record carries the group's prefix (the router reads rank 0's).
            prefix_root=f"{engine.prefix_root:x}" if rank == 0 and engine.cfg.prefix_cache else "",
            prefix_hashes=format_hashes(hashes) if rank == 0 else "",
        )
        for rank, (pid, ok) in enumerate(zip(pids, alive, strict=True))
    ]


def loading_record(cfg: EngineConfig, address: str, group_id: str, loading: str) -> WorkerRecord:
    """The leader's record while its group loads: not healthy (no router sends it work),
    saying how far each rank is (`loading`); its first heartbeat serving replaces it."""
    par = cfg.parallel
    return WorkerRecord(
        worker_id=f"{group_id}/rank0",
        role=WorkerRole.DECODE,
        address=address,
        pid=os.getpid(),
        group_id=group_id,
        healthy=False,
        loading=loading,
        tp=par.tp,
        latent_groups=par.latent_groups,
        parallel=par.name,
        model=cfg.model,
    )
