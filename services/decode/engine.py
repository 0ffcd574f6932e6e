"""The decode engine: a leader (rank 0, in this process) driving a TP group of ranks.

API (thread-safe; the decode gRPC servicer is a thin shell over it):
    reserve(request_id, prompt_len, max_tokens, prompt_ids, n) -> Reservation
                                               blocks on every rank, leased (the prompt
                                               once, max_tokens per choice); reuses the
                                               longest cached prefix of prompt_ids
    write_kv(request_id, rank, n, k_pe)        a rank's shard, layer-major, into its blocks
    generate(request_id, first_tokens, params, prompt_ids, output_ids) -> TokenStream
                                               streams every choice's tokens as sampled
    abort(request_id, choices)                 at any time; blocks are freed
    load() -> Load                             running, waiting, blocks used / total

Start-up: open the group's rendezvous, spawn ranks 1..tp-1 here or wait for them to join from
elsewhere, bounded (services/decode/group/processes.py), load this rank's share, meet every
rank at a barrier, and learn where each rank's KV receiver is.

n > 1 choices: the prompt's KV arrives once; `generate` forks it into n sequences (shared
full blocks, a copied last block: see Scheduler) that decode side by side in the batch, each
with its own generator and its own controls (penalty counts and grammar state forked from
the request's at its first token), and stream into one TokenStream with each event's choice
index.

All collectives run on one loop thread: callers enqueue commands and wait on futures. Each
loop iteration applies commands, expires leases, and runs one decode step for every running
sequence (continuous batching: requests join and leave between steps).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from common.kv.block_pool import RankPools
from common.kv.chunks import owned_ranges
from common.kv.prefix_cache import block_hashes, model_identity
from common.kv.slots import token_slots
from common.messages import DecodeLoad as Load
from common.messages import TokenEvent
from common.model.args import ModelConfig
from common.rpc.convert import KvTargetInfo
from common.runtime import group_files
from common.runtime.device import rank_device
from common.runtime.ports import free_port
from common.sampling.sampler import (
    DECODE_STAGE,
    SamplingParams,
    choice_stream,
    make_generator,
    sample_batch,
)
from services.decode.config import EngineConfig, Launch, rank_latent_columns
from services.decode.controls import SequenceControls, StepControls
from services.decode.group.processes import GroupProcesses
from services.decode.group.setup import create_shm_group, init_group
from services.decode.group.step_plan import CopyPlan, DecodePlan, PingPlan, WritePlan, send_plan
from services.decode.rank.runtime import RankRuntime
from services.decode.scheduler import Scheduler, SchedulerError, SeqState
from services.decode.scheduler import Sequence as DecodeSequence
from services.decode.stream import EngineError, Reservation, TokenStream

if TYPE_CHECKING:
    import grpc

_IDLE_WAIT_S = 0.05


@dataclass
class _Active:
    params: SamplingParams
    stream: TokenStream
    generator: torch.Generator
    controls: SequenceControls
    choice: int = 0


class DecodeEngine:
    def __init__(self, cfg: EngineConfig, *, eos_token_ids: tuple[int, ...] | None = None) -> None:
        # Every rank's device here exists (one GPU per rank), checked before anything starts.
        spawn = cfg.launch is Launch.SPAWN
        rank_device(cfg.device, cfg.parallel.tp - 1 if spawn else 0)
        if cfg.parallel.tp > 1 and cfg.master_port == 0:
            cfg = replace(cfg, master_port=free_port())
        # The group's file has a name from here to the barrier. Whoever sees the group end
        # in between removes it: this process on an exception (below), a follower that fails
        # or sees this process gone (group/follower.py), `tpla serve` once this process
        # is gone (the name carries its pid), `tpla decode` on SIGTERM (service.py).
        shm_path = create_shm_group(cfg) if spawn else None
        cfg = replace(cfg, shm_path=shm_path)
        self.cfg = cfg
        self._receiver: grpc.Server | None = None
        self.processes = GroupProcesses(cfg)
        try:
            self.processes.start()
            init_group(cfg, 0, self.processes.store)
            self.runtime = RankRuntime(cfg, 0)
            self._receiver = self.runtime.start_kv_receiver()
            self.runtime.comm.barrier()
            # Where each rank receives its KV shards: its own receiver, wherever it runs.
            own = cfg.kv_addresses(0) if self._receiver is not None else ("", "")
            self.kv_endpoints = [own, *self.processes.endpoints()]
        except BaseException as exc:
            self._abort_start(exc)
            raise
        finally:
            # Every rank has mapped the group file by the barrier (or failed): its name can
            # go, so a crash later leaves nothing behind in /dev/shm.
            if shm_path is not None:
                group_files.remove(shm_path)
        model_cfg: ModelConfig = self.runtime.model.config
        self.vocab_size = model_cfg.vocab_size
        self.eos_token_ids = frozenset(
            eos_token_ids if eos_token_ids is not None else model_cfg.eos_token_ids
        )
        max_len = cfg.max_model_len or model_cfg.max_position_embeddings
        par = cfg.parallel
        self.pool = RankPools(
            self.runtime.cache.num_blocks,
            cfg.block_size,
            par.tp,
            par.chunk_size if par.sp else None,
            prefix_cache=cfg.prefix_cache,
        )
        # The root of this group's block hash chains: the model and its side file.
        self.prefix_root = model_identity(cfg.model, cfg.reparam) if cfg.prefix_cache else 0
        self.scheduler = Scheduler(self.pool, cfg.max_batch, max_len)
        self._active: dict[str, _Active] = {}
        self._commands: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._step_started: float | None = None  # time.monotonic() of the running step
        # Idle keep-alive: well inside the followers' collective timeout.
        self._ping_interval = min(1.0, cfg.collective_timeout_s / 4)
        self._next_ping = time.monotonic() + self._ping_interval
        # Recent step times (metrics); bounded so the loop never grows or copies it.
        self.step_seconds: deque[float] = deque(maxlen=100)
        # Called with each step's seconds and batch size on the loop thread (the service's
        # histogram, `tpla bench decode-step`).
        self.on_step: Callable[[float, int], None] | None = None
        # Rank k's logits are padded to a common width for the gather; these columns of the
        # gathered row are the real vocabulary, in order. Computed once, used every step.
        padded = self.runtime.model.vocab_size_padded
        self.controls = StepControls(
            cfg.model, self.vocab_size, self.eos_token_ids, cfg.max_batch, self.runtime.device
        )
        self._vocab_columns = torch.cat(
            [
                k * padded + torch.arange(len(chunk))
                for k, chunk in enumerate(
                    torch.tensor_split(torch.arange(self.vocab_size), cfg.parallel.tp)
                )
            ]
        ).to(self.runtime.device)
        self._thread = threading.Thread(target=self._loop, name="decode-leader", daemon=True)
        self._thread.start()

    # -- public API --------------------------------------------------------------------------

    def reserve(
        self,
        request_id: str,
        prompt_len: int,
        max_tokens: int,
        prompt_ids: Sequence[int] = (),
        n: int = 1,
    ) -> Reservation:
        """Blocks for the prompt once and max_tokens for each of the n choices, on every
        rank. With `prompt_ids` (and prefix caching on), the blocks of the longest cached
        prefix are reused: `cached_tokens` of them."""
        if prompt_ids and len(prompt_ids) != prompt_len:
            raise SchedulerError(f"{len(prompt_ids)} prompt ids for a prompt of {prompt_len}")
        hashes = (
            block_hashes(self.prefix_root, prompt_ids, self.cfg.block_size)
            if self.cfg.prefix_cache
            else []
        )

        def run() -> Reservation:
            deadline = time.monotonic() + self.cfg.lease_seconds
            tables = self.scheduler.reserve(request_id, prompt_len, max_tokens, deadline, hashes, n)
            width = self.runtime.layout.latent_width
            return Reservation(
                request_id,
                self.cfg.block_size,
                tables,
                [width] * self.cfg.parallel.tp,
                self.scheduler.seqs[request_id].cached_tokens,
            )

        return self._call(run)

    def kv_targets(self, reservation: Reservation, prompt_len: int) -> list[KvTargetInfo]:
        """Where each rank's shard of a reserved request goes, and which part it is: the
        prompt tokens after the cached prefix, into the blocks after the cached ones (the
        prefix is whole blocks on every rank, so the shard starts at a block boundary)."""
        cfg, par = self.cfg, self.cfg.parallel
        d_c = self.runtime.model.config.kv_lora_rank
        cached = reservation.cached_tokens
        targets = []
        for rank, table in enumerate(reservation.block_tables):
            cols = rank_latent_columns(par, rank, d_c)
            blocks = table[self.pool.local_tokens(rank, cached) // cfg.block_size :]
            ranges: tuple[int, ...] = ()
            if par.sp:
                owned = owned_ranges(prompt_len, rank, par.chunk_size, par.tp)
                # An empty list means "every token" on the wire, so "none" is (0, 0).
                ranges = tuple(
                    x for lo, hi in owned if hi > cached for x in (max(lo, cached), hi)
                ) or (0, 0)
            grpc_addr, torch_addr = self.kv_endpoints[rank]
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

    def write_kv(self, request_id: str, rank: int, n: Tensor, k_pe: Tensor) -> None:
        """Write rank `rank`'s shard of the prompt: n [L, N, w], k_pe [L, N, d_r].

        N is the prompt length, or in SP mode the number of prompt tokens the rank owns.
        """

        def run() -> None:
            seq = self.scheduler.seqs.get(request_id)
            if seq is None or seq.state is not SeqState.RESERVED:
                raise SchedulerError(f"request {request_id!r} has no open reservation")
            if not 0 <= rank < self.cfg.parallel.tp:
                raise SchedulerError(f"rank {rank} is outside the group of {self.cfg.parallel.tp}")
            layout = self.runtime.layout
            skip = self.pool.local_tokens(rank, seq.cached_tokens)  # held already
            tokens = self.pool.local_tokens(rank, seq.prompt_len) - skip
            expected = (layout.num_layers, tokens, layout.latent_width)
            expected_rope = (*expected[:2], layout.rope_width)
            if tuple(n.shape) != expected or tuple(k_pe.shape) != expected_rope:
                raise SchedulerError(
                    f"KV shard for rank {rank} has shape {tuple(n.shape)}, expected {expected}"
                )
            if tokens == 0:
                return  # an SP rank that owns none of a short prompt
            slots = self._slots(request_id, rank, tokens, skip)
            device, comm = self.runtime.device, self.runtime.comm
            n_ = n.to(device, layout.dtype).contiguous()
            k_ = k_pe.to(device, layout.dtype).contiguous()
            if rank == 0:
                self.runtime.cache.write_all_layers(slots.to(device), n_, k_)
            else:
                send_plan(WritePlan(rank, slots), comm)
                comm.send(n_, rank)
                comm.send(k_, rank)

        self._call(run)

    def generate(
        self,
        request_id: str,
        first_tokens: int | list[int],
        params: SamplingParams,
        prompt_ids: Sequence[int] = (),
        output_ids: Sequence[int] = (),
    ) -> TokenStream:
        """Start the reserved request from each choice's first token (one per choice it was
        reserved for); its stream carries every choice's events. `output_ids`: what the
        request generated before on another group (a migrated request); `prompt_ids`: its
        prompt, needed only for a repetition penalty. Both feed the penalties and grammar."""
        firsts = [first_tokens] if isinstance(first_tokens, int) else list(first_tokens)
        stream = TokenStream(len(firsts))
        # The grammar is compiled and replayed here, off the loop thread: a new schema must
        # not stall the running sequences' steps. Each choice's copy takes its first token.
        matcher = self.controls.matcher(params, output_ids)

        def run() -> None:
            seqs = self.scheduler.start(request_id, firsts)
            self._copy_blocks(seqs)
            # The request's controls before its first tokens, forked once per choice.
            base = self.controls.start(params, matcher, prompt_ids, output_ids)
            controls = [base, *(self.controls.fork(base) for _ in seqs[1:])]
            self.controls.advance(controls, firsts)
            for seq, ctl in zip(seqs, controls, strict=True):
                stage = choice_stream(seq.choice, DECODE_STAGE)
                generator = make_generator(params, self.runtime.device, stream=stage)
                self._active[seq.seq_id] = _Active(params, stream, generator, ctl, seq.choice)
            for seq, ctl in zip(seqs, controls, strict=True):
                token = seq.generated[0]
                reason = params.finish_reason(token, 1, self.eos_token_ids, seq.max_tokens)
                if reason is None and ctl.failed:
                    reason = f"error: structured output: {ctl.failed}"
                if reason is not None:
                    self._finish(seq.seq_id, reason)

        self._call(run)
        return stream

    def abort(self, request_id: str, choices: frozenset[int] | None = None) -> bool:
        """End the request's live choices (only `choices` when given); whether any was."""

        def run() -> bool:
            ended = self.scheduler.abort(request_id, choices)
            for seq in ended:
                active = self._pop_active(seq.seq_id)
                if active is not None:
                    active.stream.put(TokenEvent(None, "abort", index=seq.choice))
            return bool(ended)

        return self._call(run)

    def load(self, timeout: float | None = None) -> Load:
        """The group's load; EngineError if the loop does not answer within `timeout`."""

        def run() -> Load:
            reserved = sum(s.state is SeqState.RESERVED for s in self.scheduler.seqs.values())
            return Load(
                self.scheduler.num_running,
                self.scheduler.num_waiting,
                reserved,
                self.pool.num_used,
                self.pool.num_blocks,
                self.cfg.block_size,
                blocks_cached=self.pool.num_cached,
                prefix_queried_tokens=self.scheduler.prefix_queried_tokens,
                prefix_hit_tokens=self.scheduler.prefix_hit_tokens,
            )

        return self._call(run, timeout)

    def cached_hashes(self, limit: int, timeout: float | None = None) -> list[int]:
        """Up to `limit` block hashes this group holds, most recently used first (what it
        publishes for KV-aware routing); EngineError if the loop does not answer in time."""
        return self._call(lambda: self.pool.recent_hashes(limit), timeout)

    def run_between_steps(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the loop thread between two decode steps and return its result: every
        running sequence waits for it (a colocated server's prefill does exactly this)."""
        return self._call(fn)

    def parameter_bytes(self) -> int:
        return self.runtime.model.parameter_bytes()

    def follower_alive(self) -> list[bool]:
        """Whether each rank's process is running: rank 0 (this process) while its loop
        has not failed, then each follower (GroupProcesses.alive)."""
        return [self._error is None, *self.processes.alive()]

    @property
    def follower_pids(self) -> list[int]:
        """Each follower's pid, as it introduced itself (on its own host)."""
        return self.processes.pids

    @property
    def failed(self) -> BaseException | None:
        return self._error

    def step_running_for(self) -> float:
        """Seconds the current decode step has been running (0 between steps): a step that
        never ends means a rank hangs, and the group reports itself unhealthy."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def shutdown(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(timeout=30)
        if self._receiver is not None:
            self._receiver.stop(grace=1)
        self.processes.stop()

    def __enter__(self) -> DecodeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- the loop ------------------------------------------------------------------------------

    def _call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        if self._error is not None:
            raise EngineError(f"decode group failed: {self._error}")
        if self._stop.is_set():
            raise EngineError("decode engine is shut down")
        fut: Future[Any] = Future()
        self._commands.put((fn, fut))
        try:
            return fut.result(timeout)
        except FutureTimeout:
            raise EngineError(f"the decode loop did not answer within {timeout:g} s") from None

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.processes.check()
                self._drain_commands(block=not self.scheduler.has_work())
                for rid in self.scheduler.expire_leases(time.monotonic()):
                    self._pop_active(rid)
                batch = self.scheduler.schedule()
                if batch:
                    self._step(batch)
                elif self.cfg.parallel.tp > 1 and time.monotonic() >= self._next_ping:
                    self._ping()
            if self.cfg.parallel.tp > 1:
                send_plan(None, self.runtime.comm)
        except BaseException as exc:  # a rank died or a collective timed out
            self._error = exc
        finally:
            # No stream may wait forever: every live request ends, whatever stopped the loop.
            reason = f"error: {self._error}" if self._error else "error: decode engine shut down"
            for active in self._active.values():
                active.stream.put(TokenEvent(None, reason, index=active.choice))
            self._active.clear()
            self._fail_pending_commands()
            if dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()

    def _drain_commands(self, block: bool) -> None:
        try:
            item = (
                self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            fn, fut = item
            try:
                fut.set_result(fn())
            except (SchedulerError, ValueError, RuntimeError) as exc:
                fut.set_exception(exc)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            fut.set_exception(EngineError(f"decode group stopped: {self._error or 'shutdown'}"))

    def _copy_blocks(self, seqs: list[DecodeSequence]) -> None:
        """Every rank copies the forks' own blocks from the prompt's (before their first
        step): one plan for all of a request's forks."""
        per_pool = [
            [pair for seq in seqs for pair in (seq.block_copies[k] if seq.block_copies else [])]
            for k in range(len(self.pool.pools))
        ]
        width = max(len(p) for p in per_pool)
        if not width:
            return
        pairs = torch.full((len(per_pool), width, 2), -1, dtype=torch.int64)
        for k, pool_pairs in enumerate(per_pool):
            if pool_pairs:
                pairs[k, : len(pool_pairs)] = torch.tensor(pool_pairs, dtype=torch.int64)
        plan = CopyPlan(pairs)
        if self.cfg.parallel.tp > 1:
            send_plan(plan, self.runtime.comm)
        self.runtime.copy_blocks(plan)

    def _slots(self, request_id: str, rank: int, num_tokens: int, first: int = 0) -> Tensor:
        """Cache slots of the rank's local tokens first..first+num_tokens-1 (all inside its
        reserved blocks: write_kv checked the shard's size against the reservation)."""
        blocks = torch.tensor(self.pool.tables(request_id)[rank], dtype=torch.int64)
        return token_slots(blocks, torch.arange(first, first + num_tokens), self.cfg.block_size)

    def _step(self, batch: list) -> None:
        self._step_started = time.monotonic()
        try:
            self._run_step(batch)
        finally:
            self._step_started = None
            self._next_ping = time.monotonic() + self._ping_interval

    def _ping(self) -> None:
        """Keep an idle group's followers inside their collective timeout (`PingPlan`);
        timed like a step, so a rank that hangs while idle shows as a stalled group."""
        self._step_started = time.monotonic()
        try:
            send_plan(PingPlan(), self.runtime.comm)
        finally:
            self._step_started = None
            self._next_ping = time.monotonic() + self._ping_interval

    def _run_step(self, batch: list) -> None:
        t0 = time.perf_counter()
        # [R, B, max_blocks]: one table per rank in SP mode, one shared table otherwise.
        per_seq = [self.pool.tables(s.seq_id) for s in batch]
        ranks = self.cfg.parallel.tp if self.cfg.parallel.sp else 1
        width = max(max(len(t) for t in tables) for tables in per_seq)
        block_tables = torch.full((ranks, len(batch), width), -1, dtype=torch.int64)
        for row, tables in enumerate(per_seq):
            for k in range(ranks):
                block_tables[k, row, : len(tables[k])] = torch.tensor(tables[k], dtype=torch.int64)
        plan = DecodePlan(
            torch.tensor([s.last_token for s in batch]),
            torch.tensor([s.next_position for s in batch]),
            block_tables,
        )
        tp = self.cfg.parallel.tp
        comm = self.runtime.comm
        if tp > 1:
            send_plan(plan, comm)
        local = self.runtime.step(plan)
        if tp > 1:
            parts = comm.gather(local)
            assert parts is not None  # rank 0
            logits = torch.cat(list(parts), dim=1)
        else:
            logits = local
        logits = logits[:, self._vocab_columns]
        actives = [self._active[seq.seq_id] for seq in batch]
        params = [a.params for a in actives]
        seqs = [a.controls for a in actives]
        processed = any(p.processed for p in params)
        context = None
        if processed:
            context = self.controls.context(seqs, [len(seq.generated) for seq in batch])
        tokens = sample_batch(logits, params, [a.generator for a in actives], context)
        if processed:
            self.controls.advance(seqs, [t.token_id for t in tokens])
        for row, (seq, active, tok) in enumerate(zip(batch, actives, tokens, strict=True)):
            reason = active.params.finish_reason(
                tok.token_id, len(seq.generated) + 1, self.eos_token_ids, seq.max_tokens
            )
            if reason is None and active.controls.failed:
                reason = f"error: structured output: {active.controls.failed}"
            kept = logits[row].to("cpu", copy=True) if self.cfg.record_logits else None
            active.stream.put(TokenEvent(tok, reason, kept, active.choice))
            self.scheduler.append(seq.seq_id, tok.token_id, finished=reason is not None)
            if reason is not None:
                self._pop_active(seq.seq_id)
        seconds = time.perf_counter() - t0
        self.step_seconds.append(seconds)
        if self.on_step is not None:
            self.on_step(seconds, len(batch))

    def _pop_active(self, seq_id: str) -> _Active | None:
        active = self._active.pop(seq_id, None)
        if active is not None:
            self.controls.release(active.controls)
        return active

    def _finish(self, seq_id: str, reason: str) -> None:
        self.scheduler.finish(seq_id)
        active = self._pop_active(seq_id)
        assert active is not None
        active.stream.put(TokenEvent(None, reason, index=active.choice))

    def _abort_start(self, exc: BaseException) -> None:
        """The group failed to start: stop the followers (a follower's own start-up error
        has ended it already), and raise a follower's reported error as the cause."""
        if self._receiver is not None:
            self._receiver.stop(grace=0)
        self.processes.stop(grace_s=1.0)
        if dist.is_initialized():  # a later engine in this process starts a group again
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self.processes.raise_start_error(exc)
