"""How a prefill group's ranks tell the leader what became of their KV sends.

Rank j (j > 0) ships the shards of its decode ranks while the group goes on to the next
batch, so its outcome cannot ride on a collective: when the last send of a job's piece (a
chunk of its prompt, or the whole prompt) on the rank ends, the rank writes one report (the
bytes acknowledged, or the first error) under the piece's key (its `seq` in the plan) in the
group's rendezvous store and bumps a counter. The leader's `Reports` thread watches
the counter (one round trip a poll, however many jobs are pending) and resolves each
expected report's future, or fails it at its deadline, or when the group has failed. A rank
also keeps the count of the prompts it holds between pieces under its own key (`held`), so
a prompt the leader dropped can be seen gone from every rank.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta

import torch.distributed as dist

from common.kv.transfer import TransferError
from common.runtime.errors import Unavailable
from services.prefill.shipping import when_all

_PREFIX = "tpla/prefill/sent"
_COUNT = f"{_PREFIX}/count"
_POLL_S = 0.002


def _key(seq: int, rank: int) -> str:
    return f"{_PREFIX}/{seq}/{rank}"


def _held_key(rank: int) -> str:
    return f"tpla/prefill/held/{rank}"


def report_held(store: dist.Store, rank: int, prompts: int) -> None:
    """Rank `rank` holds `prompts` prompts between their pieces."""
    with contextlib.suppress(dist.DistError):  # the leader is gone: the group ends anyway
        store.set(_held_key(rank), str(prompts))


def report_when_sent(store: dist.Store, seq: int, rank: int, sends: list[Future[int]]) -> None:
    """A rank's report on piece `seq`, written once every send in `sends` has ended."""

    def ended() -> None:
        errors = [_error(s) for s in sends if _error(s) is not None]
        outcome = {"error": errors[0]} if errors else {"bytes": sum(s.result() for s in sends)}
        _write(store, seq, rank, outcome)

    when_all(sends, ended)


def _error(send: Future[int]) -> str | None:
    if send.cancelled():
        return "the prefill rank closed before the KV was pushed"
    exc = send.exception()
    return None if exc is None else str(exc)


def _write(store: dist.Store, seq: int, rank: int, outcome: dict[str, object]) -> None:
    try:
        store.set(_key(seq, rank), json.dumps(outcome))
        store.add(_COUNT, 1)
    except dist.DistError:  # the leader is gone: the group ends anyway
        pass


class Reports:
    """The leader's side: a future per (piece, rank) it expects a report from."""

    def __init__(self, addr: str, port: int, failed: Callable[[], BaseException | None]) -> None:
        # Its own connection to the store: the leader's other threads use theirs.
        self._store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=30))
        self._address = (addr, port)
        self._failed = failed
        self._pending: dict[str, tuple[Future[int], float, str]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # A report may come before the leader expects it (its own ship call comes later).
        self._new = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefill-reports", daemon=True)
        self._thread.start()

    def expect(self, seq: int, rank: int, timeout_s: float, request_id: str) -> Future[int]:
        """The future of rank `rank`'s report on piece `seq`: the bytes its decode ranks
        acknowledged, or TransferError."""
        fut: Future[int] = Future()
        what = f"prefill rank {rank} (KV of {request_id})"
        with self._lock:
            self._pending[_key(seq, rank)] = (fut, time.monotonic() + timeout_s, what)
        self._new.set()
        return fut

    def held(self, rank: int) -> int:
        """The prompts rank `rank` last said it holds between their pieces."""
        key = _held_key(rank)
        store = dist.TCPStore(*self._address, is_master=False, timeout=timedelta(seconds=30))
        return int(store.get(key)) if store.check([key]) else 0

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._fail_all("the prefill group closed before its ranks reported")

    def _run(self) -> None:
        seen = -1
        while not self._stop.wait(_POLL_S):
            try:
                count = self._store.add(_COUNT, 0)
                if count != seen or self._new.is_set():
                    seen = count
                    self._new.clear()
                    self._collect()
                self._expire()
            except dist.DistError as exc:  # the store is gone with the group
                self._fail_all(f"the prefill group's store failed: {exc}")
                return

    def _collect(self) -> None:
        with self._lock:
            keys = list(self._pending)
        for key in keys:
            if not self._store.check([key]):
                continue
            outcome = json.loads(self._store.get(key))
            self._store.delete_key(key)
            with self._lock:
                fut, _, what = self._pending.pop(key)
            if "error" in outcome:
                fut.set_exception(TransferError(f"{what}: {outcome['error']}"))
            else:
                fut.set_result(int(outcome["bytes"]))

    def _expire(self) -> None:
        now, failed = time.monotonic(), self._failed()
        with self._lock:
            late = [k for k, (_, deadline, _) in self._pending.items() if failed or now > deadline]
            ended = [(k, *self._pending.pop(k)) for k in late]
        for _, fut, _, what in ended:
            if failed:  # not the decode side's fault: another prefill worker may do
                fut.set_exception(Unavailable(f"{what}: the prefill group failed: {failed}"))
            else:
                fut.set_exception(TransferError(f"{what}: no report in time"))

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut, _, what in pending.values():
            if not fut.done():
                fut.set_exception(TransferError(f"{what}: {reason}"))
