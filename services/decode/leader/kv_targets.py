"""Where each rank's KV shard of a reserved request goes, and which part of it that is."""

from __future__ import annotations

from common.kv.block_pool import RankPools
from common.messages import KvTargetInfo
from services.decode.group.start import RunningGroup


def kv_targets(
    group: RunningGroup,
    pool: RankPools,
    block_tables: list[list[int]],
    prompt_len: int,
    cached: int,
) -> tuple[KvTargetInfo, ...]:
    """One target per rank: its KV receiver, its latent columns (or in SP mode its token
    ranges) and its blocks. The shard is the prompt tokens after the `cached` prefix, into the
    blocks after the cached ones (the prefix is whole blocks on every rank, so the shard
    starts at a block boundary)."""
    cfg, par = group.cfg, group.cfg.parallel
    d_c = group.runtime.model.config.kv_lora_rank
    targets = []
    for rank, table in enumerate(block_tables):
        cols = par.latent_columns(rank, d_c)
        blocks = table[pool.local_tokens(rank, cached) // cfg.block_size :]
        grpc_addr, torch_addr = group.kv_endpoints[rank]
        targets.append(
            KvTargetInfo(
                rank,
                grpc_addr,
                torch_addr,
                cols.start,
                cols.stop - cols.start,
                tuple(blocks),
                par.token_ranges(rank, cached, prompt_len),
            )
        )
    return tuple(targets)
