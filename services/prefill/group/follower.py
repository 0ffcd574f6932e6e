"""A follower rank of a prefill group: join the group, then run the leader's batch plans
until it ends.

One the leader spawned runs `python -m services.prefill.group.follower RANK LEADER_PID`
with the leader's config as JSON in TPLA_PREFILL_CONFIG; a rank started on its own
(`tpla prefill --rank K`, or the first rank of a host, `tpla prefill --node K`) builds its
config from its settings and calls `follower_main`, which spawns the rest of its host's
ranks the same way.
Each plan: forget the prompts the leader dropped, look up each new prompt's cached prefix in
this rank's replica of the prefix cache (the same hit as the leader's, or the replicas have
diverged: the rank fails), prefill its share of every prompt's next piece over the prompt's
past, hand its logits shard to the leader's gather, keep each chunked prompt's latents and
store the new blocks in the replica as the leader's worker does (`PromptProgress`), and ship
its decode ranks' shards (j, j + N, ...) of the rows each piece finished, reporting each
piece's outcome through the group's store; a prompt is forgotten after its last piece. An
idle leader's pings keep the wait for the next plan inside the collective timeout. A
spawned rank ignores SIGINT / SIGTERM: its leader ends it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from concurrent.futures import Future
from typing import NoReturn

import torch
import torch.distributed as dist

from common.group.comm import Comm
from common.group.follower import next_plan, run_follower
from common.group.join import FollowerGroup
from common.group.local_ranks import LocalRanks
from common.group.setup import open_comm, startup_barrier
from common.group.vocab import gather_vocab
from common.kv.transfer import make_sender
from common.loading.loader import serving_dtype
from common.model.causal_lm import PrefillOutput
from common.model.index_keys import index_format
from common.runtime.device import rank_device
from services.prefill.batch.batch_plan import BatchPlan, JobPlan, recv_plan
from services.prefill.batch.progress import PromptProgress
from services.prefill.batch.threads import PrefillThreads
from services.prefill.config import PrefillGroupConfig, prefix_cache
from services.prefill.group.rank_loader import RankModelLoader
from services.prefill.group.reports import report_held, report_when_sent
from services.prefill.group.spec import group_spec
from services.prefill.rank.prefill_rank_model import PrefillRankModel
from services.prefill.shipping import Shipper, ships

log = logging.getLogger(__name__)

# The leader hands a spawned rank its config in the environment, not on the command line: the
# config holds the internal token, and any local user can read a process's arguments.
CONFIG_ENV = "TPLA_PREFILL_CONFIG"
# Run as `python -m services.prefill.group.follower RANK LEADER_PID`.
FOLLOWER_MODULE = "services.prefill.group.follower"


class RankState:
    """What a follower rank holds between plans: its model share, its prefix-cache replica and
    the prompts it is prefilling in pieces, by request id (what the leader's worker keeps of
    them, `PromptProgress`)."""

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
        fmt = index_format(model.config, cfg.index_cache_dtype, serving_dtype(cfg.dtype))
        self.shipper = Shipper(sender, self.device, key_format=fmt)
        self.cache = prefix_cache(cfg)
        self.threads = PrefillThreads.of(cfg.torch_threads, cfg.prefill_threads)
        self.prompts: dict[str, PromptProgress] = {}
        self._held = 0  # len(prompts) as last reported

    def run(self, plan: BatchPlan) -> None:
        for request_id in plan.dropped:
            self.prompts.pop(request_id, None)
        progress = [self._progress(job) for job in plan.jobs]
        found = [p.done for p in progress]
        mine = [(p.done, p.piece()) for p in progress]
        leaders = [(job.hit, len(job.new_ids)) for job in plan.jobs]
        if mine != leaders:
            raise RuntimeError(
                f"prefill rank {self.rank}'s pieces (start, tokens) are {mine} where the "
                f"leader's are {leaders}: the prefix-cache replicas diverged"
            )
        try:
            with self.threads.applied(sum(plan.lens)):  # as the leader's batch
                out = self.model.prefill(
                    plan.ids(self.device),
                    plan.lens,
                    all_logits=plan.all_logits,
                    past=[p.past() for p in progress] if any(found) else None,
                    next_ids=plan.next_ids(self.device),
                )
        except Exception:  # the leader's own prefill failed alike: the batch is skipped
            log.exception("prefill rank %d: batch failed", self.rank)
            for job in plan.jobs:  # and the leader drops its prompts
                self.prompts.pop(job.order.request_id, None)
            self._report_held()
            return
        gather_vocab(self.comm, out.logits, self.model.config.vocab_size)
        start = 0
        for job, p, length in zip(plan.jobs, progress, plan.lens, strict=True):
            self._piece(job, p, out, start)
            start += length
        self._report_held()

    def _progress(self, job: JobPlan) -> PromptProgress:
        """The prompt `job` is a piece of, started at its first piece: after the cached prefix
        this rank's replica holds (the leader's hit, unless the replicas diverged)."""
        cache = self.cache
        hashes = cache.hashes(job.prompt_ids) if cache is not None else []
        progress = self.prompts.get(job.order.request_id)
        if progress is not None:
            progress.hashes = hashes  # the prompt's blocks up to this piece's end
            return progress
        # Every piece but the last is one chunk long: a first piece shorter than the rest of
        # the prompt is the leader's chunk (one as long is the whole prompt).
        length, piece = job.order.num_tokens, len(job.new_ids)
        progress = PromptProgress(length, piece if job.hit + piece < length else 0)
        use = cache is not None and job.lookup
        progress.start(hashes, cache.lookup(hashes, len(job.prompt_ids)) if use else None)
        self.prompts[job.order.request_id] = progress
        return progress

    def _piece(self, job: JobPlan, progress: PromptProgress, out: PrefillOutput, row: int) -> None:
        """As the leader's worker: keep the piece (rows from `row` of `out`), store its blocks
        in the replica, ship this rank's decode ranks' shards of the rows it finished and
        report them; a prompt whose last piece this was is forgotten."""
        order, tp = job.order, self.cfg.tp
        progress.advance(out, row, self.cache)
        if any(ships(t.rank, self.rank, tp) for t in order.targets):
            sends: list[Future[int]] = []
            lo, hi = progress.sends.rows, progress.done - order.skip
            if hi > lo:
                n, k_pe, keys = progress.unshipped(out, row, order.skip)
                sends = self.shipper.ship(order, n, k_pe, self.rank, tp, rows=(lo, hi), keys=keys)
                progress.sends.add(sends, hi, time.perf_counter())
            report_when_sent(self.store, job.seq, self.rank, sends)
        if not progress.left:
            del self.prompts[order.request_id]

    def _report_held(self) -> None:
        if len(self.prompts) != self._held:
            self._held = len(self.prompts)
            report_held(self.store, self.rank, self._held)


def follower_main(
    cfg: PrefillGroupConfig, rank: int, loader: RankModelLoader, leader: int | None = None
) -> NoReturn:
    """A follower rank: join the group, run the leader's plans until its end, then end the
    process with its exit code (common/group/follower.py). `leader`: the pid of the leader
    that spawned this process (None: started on its own)."""
    torch.set_num_threads(cfg.torch_threads)  # as its leader's (`tpla prefill`)
    spec = group_spec(cfg)

    def start(group: FollowerGroup) -> RankState:
        device = rank_device(cfg.device, spec.local_index(rank))
        comm = open_comm(spec, rank, device)
        state = RankState(cfg, rank, comm, loader(cfg, rank, comm, device), group.store)
        startup_barrier(spec)  # the leader waits until every rank has loaded its share
        if leader is None:
            print(
                f"prefill rank {rank} of {cfg.tp} joined the group at {group.address}", flush=True
            )
        return state

    def serve(state: RankState) -> None:
        while (plan := next_plan(spec, rank, lambda: recv_plan(state.comm))) is not None:
            if isinstance(plan, BatchPlan):
                state.run(plan)

    local = spawned_ranks(cfg, rank) if leader is None else None
    return run_follower(
        spec, rank, cfg.shm_path, leader, start, serve, lambda state: state.shipper.close(), local
    )


def spawned_ranks(cfg: PrefillGroupConfig, first: int) -> LocalRanks:
    """The ranks the process running rank `first` spawns beside it: the rest of its host's."""
    return LocalRanks(group_spec(cfg), first, ["-m", FOLLOWER_MODULE], {CONFIG_ENV: cfg.to_json()})


if __name__ == "__main__":
    # python -m services.prefill.group.follower RANK LEADER_PID
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    from services.prefill.group.rank_loader import load_group_rank

    follower_main(
        PrefillGroupConfig.from_json(os.environ.pop(CONFIG_ENV)),
        int(sys.argv[1]),
        load_group_rank,
        int(sys.argv[2]),
    )
