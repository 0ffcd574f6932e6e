"""A follower rank of a prefill group: join the group, then run the leader's batch plans
until it ends.

One the leader spawned runs `python -m services.prefill.group.follower RANK LEADER_PID`
with the leader's config as JSON in TPLA_PREFILL_CONFIG; a rank started on its own
(`tpla prefill --rank K`) builds its config from its settings and calls `follower_main`.
Each plan: look up each prompt's cached prefix in this rank's replica of the prefix cache
(the same hit as the leader's, or the replicas have diverged: the rank fails), prefill its
share, hand its logits shard to the leader's gather, store the new blocks in the replica
as the leader does, and ship its decode ranks' shards (j, j + N, ...), reporting each job's
outcome through the group's store. A spawned rank ignores SIGINT / SIGTERM: its leader
ends it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import torch
import torch.distributed as dist

from common.group.comm import Comm
from common.group.follower import run_follower
from common.group.join import FollowerGroup
from common.group.setup import open_comm
from common.group.vocab import gather_vocab
from common.kv.transfer import make_sender
from common.runtime.device import rank_device
from services.prefill.group.config import (
    CONFIG_ENV,
    PrefillGroupConfig,
    group_spec,
    prefix_cache,
)
from services.prefill.group.rank_model import RankModelLoader
from services.prefill.group.reports import report_when_sent
from services.prefill.plan import BatchPlan, recv_plan
from services.prefill.rank.model import PrefillRankModel
from services.prefill.shipping import Shipper, ships, unshipped
from services.prefill.threads import PrefillThreads

log = logging.getLogger(__name__)


class RankState:
    """What a follower rank holds between plans."""

    def __init__(
        self,
        cfg: PrefillGroupConfig,
        rank: int,
        comm: Comm,
        model: PrefillRankModel,
        store: dist.Store,
    ) -> None:
        self.cfg, self.rank, self.comm, self.model, self.store = cfg, rank, comm, model, store
        self.device = rank_device(cfg.device, group_spec(cfg).local_index(rank))
        sender = make_sender(cfg.transport, f"{cfg.worker_id}-rank{rank}", cfg.token)
        self.shipper = Shipper(sender, self.device)
        self.cache = prefix_cache(cfg)
        self.threads = PrefillThreads.of(cfg.torch_threads, cfg.prefill_threads)

    def run(self, plan: BatchPlan) -> None:
        cache = self.cache
        hashes = [cache.hashes(job.prompt_ids) if cache is not None else [] for job in plan.jobs]
        pasts = [
            cache.lookup(h, len(job.prompt_ids)) if cache is not None and job.lookup else None
            for h, job in zip(hashes, plan.jobs, strict=True)
        ]
        found = [p.length if p is not None else 0 for p in pasts]
        if found != [job.hit for job in plan.jobs]:
            raise RuntimeError(
                f"prefill rank {self.rank}'s prefix cache found {found} cached tokens where "
                f"the leader's found {[job.hit for job in plan.jobs]}: the replicas diverged"
            )
        try:
            with self.threads.applied(sum(plan.lens)):  # as the leader's batch
                out = self.model.prefill(
                    plan.ids(self.device),
                    plan.lens,
                    all_logits=plan.all_logits,
                    past=pasts if any(found) else None,
                )
        except Exception:  # the leader's own prefill failed alike: the batch is skipped
            log.exception("prefill rank %d: batch failed", self.rank)
            return
        gather_vocab(self.comm, out.logits, self.model.config.vocab_size)
        start, tp = 0, self.cfg.tp
        for job, h, past, length in zip(plan.jobs, hashes, pasts, plan.lens, strict=True):
            end = start + length
            if cache is not None:
                cache.store(h, out.n, out.k_pe, job.hit, start)
            if any(ships(t.rank, self.rank, tp) for t in job.order.targets):
                n, k_pe = unshipped(out, start, end, past, job.order.skip)
                sends = self.shipper.ship(job.order, n, k_pe, self.rank, tp)
                report_when_sent(self.store, job.seq, self.rank, sends)
            start = end


def follower_main(
    cfg: PrefillGroupConfig, rank: int, loader: RankModelLoader, leader: int | None = None
) -> int:
    """A follower rank: join the group, run the leader's plans until its end; the exit code
    (common/group/follower.py). `leader`: the pid of the leader that spawned this process
    (None: started on its own)."""
    torch.set_num_threads(cfg.torch_threads)  # as its leader's (`tpla prefill`)
    spec = group_spec(cfg)

    def start(group: FollowerGroup) -> RankState:
        device = rank_device(cfg.device, spec.local_index(rank))
        comm = open_comm(spec, rank, device)
        state = RankState(cfg, rank, comm, loader(cfg, rank, comm, device), group.store)
        comm.barrier()  # the leader waits until every rank has loaded its share
        if leader is None:
            print(
                f"prefill rank {rank} of {cfg.tp} joined the group at {group.address}", flush=True
            )
        return state

    def serve(state: RankState) -> None:
        while (plan := recv_plan(state.comm)) is not None:
            state.run(plan)

    return run_follower(
        spec, rank, cfg.shm_path, leader, start, serve, lambda state: state.shipper.close()
    )


if __name__ == "__main__":
    # python -m services.prefill.group.follower RANK LEADER_PID
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    from services.prefill.group.rank_model import load_group_rank

    sys.exit(
        follower_main(
            PrefillGroupConfig.from_json(os.environ.pop(CONFIG_ENV)),
            int(sys.argv[1]),
            load_group_rank,
            int(sys.argv[2]),
        )
    )
