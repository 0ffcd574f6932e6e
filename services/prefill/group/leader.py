"""A prefill group as its leader runs it: the `PrefillRunner` of a worker whose batches run
on N ranks.

Start-up: open the group's rendezvous (common/group), spawn ranks 1..N-1 here or wait for
them to join, load this rank's share, meet every rank at a barrier. Each batch: the plan to
every rank over the control group -> every rank prefills its share -> the vocabulary
shards of the logits gathered here, where the worker samples -> each rank ships the shards
of its decode ranks (this one: 0, N, 2N, ...) and reports the others' outcomes through the
store (services/prefill/group/reports.py). With the MTP layer, every rank's output holds
its latents as one more layer, and the worker sends this rank's hidden state (whole on every
rank) with the first tokens. While no batch runs the leader pings its ranks about every
second (`PingPlan`, as an idle decode leader does), keeping their wait for the next plan
inside the collective timeout. A collective that fails (a rank died, or hung past the
collective timeout) fails the batch, or the ping, and the group: `failed` is set, and the
service reports itself unhealthy and exits.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace

import torch.distributed as dist
from torch import Tensor

from common.group.comm import Comm
from common.group.errors import RankExited
from common.group.processes import GroupProcesses
from common.group.setup import create_shm_group, init_group, open_comm, startup_barrier
from common.group.vocab import gather_vocab
from common.kv.transfer import make_sender
from common.loading.loader import serving_dtype
from common.model.causal_lm import PastLatents, PrefillOutput
from common.model.index_keys import index_format
from common.runtime import group_files
from common.runtime.device import rank_device
from common.runtime.errors import Unavailable
from common.runtime.load_meter import current_meter
from common.runtime.ports import free_port
from services.prefill.batch.batch_plan import BatchPlan, JobPlan, send_ping, send_plan
from services.prefill.config import PrefillGroupConfig
from services.prefill.group.follower import spawned_ranks
from services.prefill.group.rank_loader import RankModelLoader
from services.prefill.group.reports import Reports
from services.prefill.group.spec import group_spec
from services.prefill.rank.prefill_rank_model import PrefillRankModel
from services.prefill.runner import PrefillRunner
from services.prefill.shipping import Send, Shipper, ships

log = logging.getLogger(__name__)

# A rank reports once its sends end, each bounded by the job's transfer timeout.
REPORT_GRACE_S = 5.0


class GroupRunner(PrefillRunner):
    def __init__(
        self,
        cfg: PrefillGroupConfig,
        processes: GroupProcesses,
        comm: Comm,
        model: PrefillRankModel,
    ) -> None:
        self.cfg, self.processes, self.comm, self.model = cfg, processes, comm, model
        self.config = model.config
        self.sends_hidden = model.mtp is not None
        self.device = rank_device(cfg.device, 0)
        self.transport = cfg.transport
        sender = make_sender(cfg.transport, cfg.worker_id, cfg.token)
        fmt = index_format(model.config, cfg.index_cache_dtype, serving_dtype(cfg.dtype))
        self.shipper = Shipper(sender, self.device, key_format=fmt)
        self._error: BaseException | None = None
        self.reports = Reports(cfg.master_addr, cfg.master_port, lambda: self.failed)
        # Per piece of the batch in flight: the other ranks' reports, expected from the plan
        # on (a piece that ships nothing here, or whose job fails, is never shipped here, but
        # its ranks still report).
        self._reports: dict[int, list[Future[int]]] = {}
        # The group's collectives run one at a time: a batch's (the batcher's thread) or a
        # ping (the keep-alive thread), never both.
        self._collectives = threading.Lock()
        self._last_plan = time.monotonic()
        self._closed = threading.Event()
        # Idle keep-alive: well inside the followers' collective timeout.
        self._ping_s = min(1.0, cfg.collective_timeout_s / 4)
        self._pinger = threading.Thread(target=self._keep_alive, name="prefill-ping", daemon=True)
        self._pinger.start()

    @classmethod
    def start(cls, cfg: PrefillGroupConfig, loader: RankModelLoader) -> GroupRunner:
        """Start the group `cfg` describes with this process as rank 0; blocks until every
        rank has loaded its share (or raises why the group cannot start)."""
        # Every device of this host's ranks exists (one GPU per rank).
        rank_device(cfg.device, group_spec(cfg).per_host - 1)
        if cfg.master_port == 0:
            cfg = replace(cfg, master_port=free_port())
        shm_path = create_shm_group(group_spec(cfg)) if cfg.spawned else None
        cfg = replace(cfg, shm_path=shm_path)
        spec = group_spec(cfg)
        processes = GroupProcesses(spec, spawned_ranks(cfg, 0))
        try:
            if (meter := current_meter()) is not None:  # the service's: the group's progress
                meter.follow(processes.loading)
            processes.start()
            init_group(spec, 0, processes.store)
            comm = open_comm(spec, 0, rank_device(cfg.device, 0))
            model = loader(cfg, 0, comm, rank_device(cfg.device, 0))
            startup_barrier(spec)
        except BaseException as exc:
            processes.stop(grace_s=1.0)
            if dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
            processes.raise_start_error(exc)
            raise
        finally:
            group_files.remove(shm_path)  # every rank has mapped it by the barrier
        return cls(cfg, processes, comm, model)

    @property
    def failed(self) -> BaseException | None:
        return self._error

    def alive(self) -> list[bool]:
        """Per rank: this one while the group has not failed, then each follower."""
        return [self._error is None, *self.processes.alive()]

    def check(self) -> None:
        if self._error is None and not all(self.processes.alive()):
            dead = [k for k, ok in enumerate(self.alive()) if not ok]
            self._error = RankExited(f"prefill rank(s) {dead} stopped")

    def prefill(self, plan: BatchPlan, past: list[PastLatents | None] | None) -> PrefillOutput:
        with self._collectives:
            try:
                return self._prefill(plan, past)
            finally:
                self._last_plan = time.monotonic()

    def _prefill(self, plan: BatchPlan, past: list[PastLatents | None] | None) -> PrefillOutput:
        if self._error is not None:
            raise Unavailable(f"the prefill worker's group has failed: {self._error}")
        try:
            self.processes.check()
            send_plan(plan, self.comm)
        except Exception as exc:
            raise self._fail(exc) from exc
        self._reports = {job.seq: self._expect(job) for job in plan.jobs}
        # A model error (bad input) happens alike on every rank, before the gather: each
        # rank skips the batch and the group goes on.
        out = self.model.prefill(
            plan.ids(self.device),
            plan.lens,
            all_logits=plan.all_logits,
            past=past,
            next_ids=plan.next_ids(self.device),
        )
        try:
            logits = gather_vocab(self.comm, out.logits, self.model.config.vocab_size)
        except Exception as exc:
            raise self._fail(exc) from exc
        assert logits is not None  # rank 0
        return PrefillOutput(logits, out.n, out.k_pe, out.hidden, out.index_keys)

    def _keep_alive(self) -> None:
        """Ping the ranks once no plan went out for `_ping_s`, until the group closes or
        fails. A ping that fails (a rank died, or hangs past the collective timeout) fails
        the group, as a batch would."""
        while not self._closed.wait(self._ping_s / 2):
            with self._collectives:
                idle = time.monotonic() - self._last_plan >= self._ping_s
                if self._error is not None or self._closed.is_set() or not idle:
                    continue
                try:
                    send_ping(self.comm)
                except Exception as exc:
                    self._fail(exc)
                    return
                self._last_plan = time.monotonic()

    def _fail(self, exc: Exception) -> Unavailable:
        """The group can run no more batches: a rank died or hung past the collective
        timeout. The batch's requests may go to another prefill worker."""
        self._error = exc
        log.error("prefill group failed: %s", exc)
        return Unavailable(f"the prefill worker's group failed: {exc}")

    def ship(
        self,
        job: JobPlan,
        n: list[Tensor],
        k_pe: list[Tensor],
        timed: Callable[[int, str, Send], Send] | None = None,
        rows: tuple[int, int] | None = None,
        keys: Sequence[Tensor] = (),
    ) -> list[Future[int]]:
        sends = self.shipper.ship(job.order, n, k_pe, 0, self.cfg.tp, timed, rows, keys)
        return sends + self._reports.pop(job.seq, [])

    def _expect(self, job: JobPlan) -> list[Future[int]]:
        """The reports of the other ranks that ship some of `job`'s shards: one per piece."""
        order, tp = job.order, self.cfg.tp
        others = sorted({k for t in order.targets for k in range(1, tp) if ships(t.rank, k, tp)})
        timeout = order.timeout_s + REPORT_GRACE_S
        return [self.reports.expect(job.seq, k, timeout, order.request_id) for k in others]

    def close(self) -> None:
        """The group's end: the last plan ends the followers."""
        self._closed.set()
        self._pinger.join(timeout=self.cfg.collective_timeout_s + 5)
        if self._error is None:
            with contextlib.suppress(Exception):
                send_plan(None, self.comm)
        self.processes.stop(grace_s=10.0 if self._error is None else 1.0)
        self.reports.close()
        self.shipper.close()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
