"""What a reserved request's prefill is told (`Reservation`): where each rank's KV shard goes,
which part of the prompt's KV it is, in what shape, and under which epoch; and what the ranks
are told first (`epoch_plan`): that the reservation's blocks are that epoch's."""

from __future__ import annotations

import torch

from common.kv.block_pool import RankPools
from common.messages import KvTargetInfo, Reservation
from services.decode.group.start import RunningGroup
from services.decode.step_plan import EpochPlan


def reservation(
    group: RunningGroup,
    pool: RankPools,
    request_id: str,
    block_tables: list[list[int]],
    prompt_len: int,
    cached: int,
    epoch: int,
) -> Reservation:
    """The request's reservation: its shards' format, its lease, each rank's target
    (`kv_targets`), the `cached` prefix tokens its blocks hold already and its `epoch`."""
    cfg, layout = group.cfg, group.runtime.layout
    return Reservation(
        request_id,
        cfg.block_size,
        layout.num_layers,
        layout.rope_width,
        cfg.dtype,
        cfg.lease_seconds,
        kv_targets(group, pool, block_tables, prompt_len, cached, epoch),
        cached,
    )


def epoch_plan(pool: RankPools, seq_ids: list[str], epoch: int) -> EpochPlan:
    """Every block a reservation's forks hold, per pool, given to `epoch`."""
    per_pool = [sorted({b for sid in seq_ids for b in p.table(sid).blocks}) for p in pool.pools]
    blocks = torch.full((len(per_pool), max(len(b) for b in per_pool)), -1, dtype=torch.int64)
    for k, ids in enumerate(per_pool):
        blocks[k, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return EpochPlan(epoch, blocks)


def kv_targets(
    group: RunningGroup,
    pool: RankPools,
    block_tables: list[list[int]],
    prompt_len: int,
    cached: int,
    epoch: int,
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
                epoch,
            )
        )
    return tuple(targets)
