"""A prompt's KV written into its reserved blocks from this process: what local tools do
(`tpla generate --tp`, the colocated and decode-step benchmarks, tests) in place of a prefill
worker shipping each rank's shard over the network (common/kv/transfer.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from common.kv.slots import token_slots
from services.decode.leader.scheduler import SchedulerError, SeqState
from services.decode.step_plan import WritePlan, send_plan

if TYPE_CHECKING:
    from services.decode.engine import DecodeEngine


def write_kv(
    engine: DecodeEngine,
    request_id: str,
    rank: int,
    n: Tensor,
    k_pe: Tensor,
    keys: Tensor | None = None,
) -> None:
    """Write rank `rank`'s shard of the reserved request's prompt: n [L, N, w], k_pe
    [L, N, d_r], layer-major, on the engine's loop thread (between two steps); with DSA its
    indexer keys too, keys [L_I, N, width] as the index-key pool stores them.

    N is the prompt length after its cached prefix, or in SP mode the number of those
    tokens the rank owns. SchedulerError without an open reservation or for a shard of
    another shape; the write renews the reservation's lease."""
    cfg, runtime, pool, scheduler = engine.cfg, engine.runtime, engine.pool, engine.scheduler

    def run() -> None:
        seq = scheduler.seqs.get(request_id)
        if seq is None or seq.state is not SeqState.RESERVED:
            raise SchedulerError(f"request {request_id!r} has no open reservation")
        if not 0 <= rank < cfg.parallel.tp:
            raise SchedulerError(f"rank {rank} is outside the group of {cfg.parallel.tp}")
        layout = runtime.layout
        skip = pool.local_tokens(rank, seq.cached_tokens)  # held already
        tokens = pool.local_tokens(rank, seq.prompt_len) - skip
        expected = (layout.num_layers, tokens, layout.latent_width)
        expected_rope = (*expected[:2], layout.rope_width)
        if tuple(n.shape) != expected or tuple(k_pe.shape) != expected_rope:
            raise SchedulerError(
                f"KV shard for rank {rank} has shape {tuple(n.shape)}, expected {expected}"
            )
        index = runtime.index_cache
        if (index is None) != (keys is None) or (
            keys is not None
            and index is not None
            and tuple(keys.shape) != (index.layout.num_layers, tokens, index.layout.latent_width)
        ):
            raise SchedulerError(f"indexer keys for rank {rank} do not fit its key pool")
        scheduler.renew(request_id, time.monotonic() + cfg.lease_seconds)
        if tokens == 0:
            return  # an SP rank that owns none of a short prompt
        # The rank's local tokens skip..skip+tokens-1, all inside its reserved blocks.
        blocks = torch.tensor(pool.tables(request_id)[rank], dtype=torch.int64)
        slots = token_slots(blocks, torch.arange(skip, skip + tokens), cfg.block_size)
        device, comm = runtime.device, runtime.comm
        n_ = n.to(device, layout.dtype).contiguous()
        k_ = k_pe.to(device, layout.dtype).contiguous()
        keys_ = None
        if keys is not None and index is not None:
            keys_ = keys.to(device, index.layout.dtype).contiguous()
        if rank == 0:
            runtime.cache.write_all_layers(slots.to(device), n_, k_)
            if keys_ is not None and index is not None:
                index.write_all_layers(slots.to(device), keys_, keys_[..., :0])
        else:
            send_plan(WritePlan(rank, slots), comm)
            comm.send(n_, rank)
            comm.send(k_, rank)
            if keys_ is not None:
                comm.send(keys_, rank)

    engine.run_between_steps(run)
