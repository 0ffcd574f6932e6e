"""The decode leader's loop thread: where every collective of the group runs.

Callers enqueue commands (`call`) and wait on futures, or enqueue them without waiting
(`post`). Each iteration applies the commands, expires leases, runs one decode step for
every running sequence (continuous batching: requests join and leave between steps), then
one piece of the prompts the group prefills itself (leader/local_prefill.py), so the running
streams step between two pieces; an idle group is pinged so its followers stay inside their
collective timeout. When the loop stops, for whatever reason, every live choice, queued
prompt and pending command ends with an error.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch.distributed as dist

from common.runtime.device import use_device
from common.runtime.errors import TplaError
from services.decode.group.start import RunningGroup
from services.decode.leader.local_prefill import LocalPrefills
from services.decode.leader.scheduler import DecodeSequence, Scheduler, SchedulerError
from services.decode.leader.step import DecodeStep
from services.decode.step_plan import PingPlan, send_plan
from services.decode.stream import EngineError

_IDLE_WAIT_S = 0.05


class LeaderLoop:
    def __init__(
        self,
        group: RunningGroup,
        scheduler: Scheduler,
        step: DecodeStep,
        prefills: LocalPrefills,
    ) -> None:
        self.group, self.scheduler, self.step = group, scheduler, step
        self.prefills = prefills
        self._commands: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._step_started: float | None = None  # time.monotonic() of the running step
        # Idle keep-alive: well inside the followers' collective timeout.
        self._ping_interval = min(1.0, group.cfg.collective_timeout_s / 4)
        self._next_ping = time.monotonic() + self._ping_interval
        self._thread = threading.Thread(target=self._run, name="decode-leader", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run `fn` on the loop thread between two steps; its result (or its error).
        EngineError if the group failed, is shut down, or (`timeout`) does not answer."""
        if self.error is not None:
            raise EngineError(f"decode group failed: {self.error}")
        if self._stop.is_set():
            raise EngineError("decode engine is shut down")
        fut: Future[Any] = Future()
        self._commands.put((fn, fut))
        try:
            return fut.result(timeout)
        except FutureTimeout:
            raise EngineError(f"the decode loop did not answer within {timeout:g} s") from None

    def post(self, fn: Callable[[], Any]) -> None:
        """Run `fn` on the loop thread between two steps without waiting for it: for a
        caller that must not wait out a step. Its result and errors are dropped; nothing
        runs once the loop has stopped."""
        if self.error is None and not self._stop.is_set():
            self._commands.put((fn, Future()))

    def step_running_for(self) -> float:
        """Seconds the current step (or ping) has been running; 0 between steps."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def stop(self) -> None:
        """End the loop (its last plan ends the followers) and wait for it."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(timeout=30)

    def _run(self) -> None:
        tp = self.group.cfg.parallel.tp
        try:
            # A new thread's current CUDA device is GPU 0: this one runs every step.
            use_device(self.group.runtime.device)
            while not self._stop.is_set():
                self.group.processes.check()
                busy = self.scheduler.has_work() or self.prefills.pending()
                self._drain_commands(block=not busy)
                for rid in self.scheduler.expire_leases(time.monotonic()):
                    self.step.drop(rid)
                batch = self.scheduler.schedule()
                if batch:
                    self._step(batch)
                if self.prefills.pending():
                    self._timed(self.prefills.run)
                elif not batch and tp > 1 and time.monotonic() >= self._next_ping:
                    self._ping()
            if tp > 1:
                send_plan(None, self.group.runtime.comm)
        except BaseException as exc:  # a rank died or a collective timed out
            self.error = exc
        finally:
            message = str(self.error) if self.error else "decode engine shut down"
            self.step.end_all(message)
            self.prefills.fail_all(message)
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
            except (SchedulerError, TplaError, ValueError, RuntimeError) as exc:
                # The command's own error (a typed TplaError: the caller's request, never
                # the group's), answered to its caller; the loop goes on.
                fut.set_exception(exc)
            except BaseException as exc:
                # The loop ends with it; its caller must not wait on a future never set.
                fut.set_exception(EngineError(f"decode group failed: {exc!r}"))
                raise
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
            fut.set_exception(EngineError(f"decode group stopped: {self.error or 'shutdown'}"))

    def _step(self, batch: list[DecodeSequence]) -> None:
        def run() -> None:
            t0 = time.perf_counter()
            self.step.run(batch)
            self.step.probe.stepped(time.perf_counter() - t0, len(batch))

        self._timed(run)

    def _ping(self) -> None:
        """Keep an idle group's followers inside their collective timeout (`PingPlan`);
        timed like a step, so a rank that hangs while idle shows as a stalled group."""
        self._timed(lambda: send_plan(PingPlan(), self.group.runtime.comm))

    def _timed(self, work: Callable[[], None]) -> None:
        """`work` on every rank (a step, a prefill piece, a ping): `step_running_for` says
        how long it runs, so one that never ends shows as a stalled group."""
        self._step_started = time.monotonic()
        try:
            work()
        finally:
            self._step_started = None
            self._next_ping = time.monotonic() + self._ping_interval
