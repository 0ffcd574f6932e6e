"""A prefill rank's KV shipping: cut the shards of one prompt that this rank ships, push them
on its pusher threads (each send a future of the bytes the decode rank acknowledged), and
follow a prompt's sends round by round until they settle.

At tp = 1 the worker's one rank ships every decode rank's shard; in a prefill group of N
ranks, each holding the whole latent, rank j ships the shards of decode ranks j, j + N, ...
(`ships`), so no rank sends everything.

A prompt's sends (`PromptSends`): empty -> a round added after each chunk's compute (one for
a prompt computed whole), carrying the rows shipped so far -> failed as soon as any send
failed (the worker then computes none of the prompt's remaining chunks) -> settled when every
send of every round finished, which resolves the request.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from common.kv.index_shards import cut_index_chunk
from common.kv.transfer import KvSender, TransferError, cut_chunk
from common.messages import KvTargetInfo
from common.model.index_keys import IndexKeyFormat
from common.runtime.device import use_device

# The send a job's trace wraps: (shard, grpc address, torch address, timeout) -> bytes.
Send = Callable[..., int]


@dataclass(frozen=True)
class ShipOrder:
    """Where one prompt's latents go: the decode group's KV targets for the positions it
    lacks (from `skip`, its cached prefix, to the prompt's end)."""

    request_id: str
    num_tokens: int  # the prompt's length
    skip: int
    block_size: int
    targets: tuple[KvTargetInfo, ...]
    timeout_s: float


def ships(target_rank: int, rank: int, tp: int) -> bool:
    """Whether prefill rank `rank` of `tp` ships decode rank `target_rank`'s shard."""
    return target_rank % tp == rank


class Shipper:
    """`sender` over a pool of pusher threads on `device` (each makes it current); a DSA
    model's indexer keys ship beside the latents in `key_format` (the decode groups')."""

    def __init__(
        self,
        sender: KvSender,
        device: torch.device,
        threads: int = 8,
        key_format: IndexKeyFormat | None = None,
    ) -> None:
        self.sender = sender
        self.key_format = key_format
        self._pushers = ThreadPoolExecutor(
            threads, "kv-push", initializer=use_device, initargs=(device,)
        )

    def ship(
        self,
        order: ShipOrder,
        n: list[Tensor],
        k_pe: list[Tensor],
        rank: int = 0,
        tp: int = 1,
        timed: Callable[[int, str, Send], Send] | None = None,
        rows: tuple[int, int] | None = None,
        keys: Sequence[Tensor] = (),
    ) -> list[Future[int]]:
        """Start the sends of `order`'s shards that rank `rank` of `tp` ships; `n` / `k_pe`
        are the prompt's latents from position `skip` on, of which rows [lo, hi) `rows` go
        now (a chunk: each decode rank places them where its earlier rows end; None: all of
        them); `keys` a DSA model's indexer keys alike (per full layer), which go to the same
        ranks as shards of their own. `timed` wraps each send (a job's trace)."""
        lo, hi = rows if rows is not None else (0, order.num_tokens - order.skip)
        mine = [t for t in order.targets if ships(t.rank, rank, tp)]
        rid, bs = order.request_id, order.block_size
        cut = [cut_chunk(n, k_pe, lo, hi, shifted(t, order.skip), rid, bs) for t in mine]
        if keys:
            fmt = self.key_format
            assert fmt is not None, "indexer keys to ship, and no key format"
            key_list = list(keys)
            cut += [
                cut_index_chunk(key_list, lo, hi, shifted(t, order.skip), rid, bs, fmt)
                for t in mine
            ]
            mine = mine * 2
        sends = []
        for shard, t in zip(self.sender.prepare(cut), mine, strict=True):
            if not shard.n.shape[1]:  # an SP rank may own none of a short prompt
                continue
            send: Send = self.sender.send
            if timed is not None:
                send = timed(t.rank, t.grpc_address, send)
            sends.append(
                self._pushers.submit(send, shard, t.grpc_address, t.torch_address, order.timeout_s)
            )
        return sends

    def close(self) -> None:
        self._pushers.shutdown(wait=False, cancel_futures=True)
        self.sender.close()


def shifted(target: KvTargetInfo, skip: int) -> KvTargetInfo:
    """An SP target with its token ranges counted from prompt position `skip`."""
    if not target.token_ranges or not skip:
        return target
    ranges = tuple(max(x - skip, 0) for x in target.token_ranges)
    return dataclasses.replace(target, token_ranges=ranges)


class PromptSends:
    def __init__(self) -> None:
        self.futures: list[Future[int]] = []
        self.rows = 0  # rows of what the decode group lacks that were handed to sends
        self.started: float | None = None  # perf_counter of the first round

    def add(self, futures: list[Future[int]], rows: int, started: float) -> None:
        """A round of sends, begun (cut) at perf_counter `started`, handing off `rows`."""
        if self.started is None:
            self.started = started
        self.futures += futures
        self.rows = rows

    def error(self) -> BaseException | None:
        """The first failed send's error, among the finished ones."""
        for send in self.futures:
            if not send.done():
                continue
            if send.cancelled():
                return TransferError("the prefill worker closed before the KV was pushed")
            if (error := send.exception()) is not None:
                return error
        return None

    def sent_bytes(self) -> int:
        return sum(send.result() for send in self.futures)


def when_all(futures: list[Future[int]], then: Callable[[], None]) -> None:
    """Call `then` once every future finished: on the thread that finished the last one, or
    on this one when none is left running."""
    remaining = len(futures)
    if not remaining:
        then()
        return
    lock = threading.Lock()

    def arrived(_: Future[int]) -> None:
        nonlocal remaining
        with lock:
            remaining -= 1
            if remaining:
                return
        then()

    for future in futures:
        future.add_done_callback(arrived)
