"""Where each rank's KV shard of a reserved request goes, and which part of it that is."""

from __future__ import annotations

from common.kv.block_pool import RankPools
from common.kv.chunks import owned_ranges
from common.rpc.convert import KvTargetInfo
from services.decode.config import rank_latent_columns
from services.decode.group.start import RunningGroup
from services.decode.stream import Reservation


def kv_targets(
    group: RunningGroup, pool: RankPools, reservation: Reservation, prompt_len: int
) -> list[KvTargetInfo]:
    """One target per rank: its KV receiver, its latent columns (or in SP mode its token
    ranges) and its blocks. The shard is the prompt tokens after the cached prefix, into the
    blocks after the cached ones (the prefix is whole blocks on every rank, so the shard
    starts at a block boundary)."""
    cfg, par = group.cfg, group.cfg.parallel
    d_c = group.runtime.model.config.kv_lora_rank
    cached = reservation.cached_tokens
    targets = []
    for rank, table in enumerate(reservation.block_tables):
        cols = rank_latent_columns(par, rank, d_c)
        blocks = table[pool.local_tokens(rank, cached) // cfg.block_size :]
        ranges: tuple[int, ...] = ()
        if par.sp:
            owned = owned_ranges(prompt_len, rank, par.chunk_size, par.tp)
            # An empty list means "every token" on the wire, so "none" is (0, 0).
            ranges = tuple(x for lo, hi in owned if hi > cached for x in (max(lo, cached), hi)) or (
                0,
                0,
            )
        grpc_addr, torch_addr = group.kv_endpoints[rank]
        targets.append(
            KvTargetInfo(
                rank,
                grpc_addr,
                torch_addr,
                cols.start,
                cols.stop - cols.start,
                tuple(blocks),
                ranges,
            )
        )
    return targets
