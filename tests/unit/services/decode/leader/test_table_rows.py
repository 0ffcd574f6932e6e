"""The ranks' block tables kept by edits (leader/table_rows.py, rank/block_tables.py): after
every step of random admits, forks, preemptions, aborts, prefix hits and finishes, every
rank's table (under SP, each rank's own) equals one rebuilt from scratch from the pools."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from common.kv.block_pool import OutOfBlocks, RankPools
from common.parallel import ParallelConfig, ParallelMode
from services.decode.leader.scheduler import DecodeSequence, Scheduler, SchedulerError, SeqState
from services.decode.leader.table_rows import TableRows
from services.decode.rank.block_tables import RankTables

BS, MAX_BATCH, MAX_LEN = 4, 6, 64
LAYOUTS = {
    "tpla": ParallelConfig(tp=2),
    "sp": ParallelConfig(tp=2, mode=ParallelMode.SP, chunk_size=4),
}


def _rebuilt(pools: RankPools, rows: TableRows, rank: int, width: int) -> torch.Tensor:
    """Rank `rank`'s tables from scratch: every held sequence's blocks in its row."""
    pool = pools.pools[rank if len(pools.pools) > 1 else 0]
    table = torch.full((MAX_BATCH + 1, width), -1, dtype=torch.int64)
    for sid, row in rows.held().items():
        blocks = pool.table(sid).blocks
        table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
    return table


def _step(sched: Scheduler, rng: random.Random, held_out: set[str]) -> list[DecodeSequence]:
    """One step's batch: the scheduler's, less the sequences preempted this step (a batch
    may leave out a running sequence and take it back later)."""
    batch = sched.schedule()
    if batch and rng.random() < 0.2:
        held_out.add(rng.choice(batch).seq_id)
    elif held_out and rng.random() < 0.5:
        held_out.pop()
    return [s for s in batch if s.seq_id not in held_out]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_table_equals_a_rebuild_after_every_step(layout: str, seed: int) -> None:
    par = LAYOUTS[layout]
    pools = RankPools(96, BS, par, prefix_cache=True)
    sched = Scheduler(pools, MAX_BATCH, MAX_LEN)
    rows = TableRows(pools, MAX_BATCH)
    width = -(-MAX_LEN // BS)
    ranks = [
        RankTables(MAX_BATCH, width, k if par.token_ranks > 1 else 0, torch.device("cpu"))
        for k in range(par.tp)
    ]
    rng = random.Random(seed)
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    held_out: set[str] = set()
    seen = {"fork": 0, "hit": 0, "abort": 0, "finish": 0, "preempt": 0, "grow": 0}
    for step in range(120):
        # Admit: a prompt (a shared one gives prefix hits), sometimes with forks (n > 1).
        if rng.random() < 0.5:
            rid = f"r{step % 9}"  # an id used before: a fresh sequence under an old name
            prompt = rng.choice(prompts) if rng.random() < 0.6 else prompts[0][:5]
            n = rng.choice([1, 1, 2, 3])
            try:
                root = rid if rng.random() < 0.3 else "shared"
                hashes = [hash((root, *prompt[: (b + 1) * BS])) for b in range(len(prompt) // BS)]
                sched.reserve(rid, len(prompt), rng.randrange(2, 12), 1e9, hashes, n)
            except (SchedulerError, OutOfBlocks):
                pass
            else:
                seen["fork"] += n > 1
                seen["hit"] += sched.seqs[rid].cached_tokens > 0
                sched.start(rid, [1] * n)
        if sched.requests and rng.random() < 0.1:
            sched.abort(rng.choice(list(sched.requests)))
            seen["abort"] += 1
        if sched.running and rng.random() < 0.15:
            # A running sequence gains a block (the scheduler reserves up front, but the
            # ranks' tables follow whatever the pools hold).
            pool = rng.choice(pools.pools)
            sid = rng.choice(sched.running)
            if len(pool.table(sid).blocks) < width:  # within the context limit
                with contextlib.suppress(OutOfBlocks):
                    pool.grow(sid, pool.table(sid).num_tokens + BS)
                    seen["grow"] += 1
        before = len(held_out)
        batch = _step(sched, rng, held_out)
        seen["preempt"] += len(held_out) > before
        if not batch:
            continue
        _, edits = rows.edits(batch)
        for k, tables in enumerate(ranks):
            tables.apply(edits)
            assert torch.equal(tables.table, _rebuilt(pools, rows, k, width)), (step, k)
        for seq in batch:
            if seq.state is not SeqState.RUNNING:
                continue
            done = len(seq.generated) + 1 >= seq.max_tokens or rng.random() < 0.05
            sched.append(seq.seq_id, 2, finished=done)
            seen["finish"] += done
    assert all(seen.values()), seen
