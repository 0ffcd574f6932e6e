"""A prefill rank's KV pushes: cut the shards of one prompt that this rank ships and push
them on its pusher threads, each send a future of the bytes the decode rank acknowledged.

At tp = 1 the worker's one rank ships every decode rank's shard; in a prefill group of N
ranks, each holding the whole latent, rank j ships the shards of decode ranks j, j + N, ...
(`ships`), so no rank sends everything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from common.kv.transfer import KvSender, cut_chunk
from common.messages import KvTargetInfo
from common.model.model import PastLatents, PrefillOutput
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
    """`sender` over a pool of pusher threads on `device` (each makes it current)."""

    def __init__(self, sender: KvSender, device: torch.device, threads: int = 8) -> None:
        self.sender = sender
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
    ) -> list[Future[int]]:
        """Start the sends of `order`'s shards that rank `rank` of `tp` ships; `n` / `k_pe`
        are the prompt's latents from position `skip` on, of which rows [lo, hi) `rows` go
        now (a chunk: each decode rank places them where its earlier rows end; None: all of
        them). `timed` wraps each send (a job's trace)."""
        lo, hi = rows if rows is not None else (0, order.num_tokens - order.skip)
        mine = [t for t in order.targets if ships(t.rank, rank, tp)]
        cut = [
            cut_chunk(n, k_pe, lo, hi, shifted(t, order.skip), order.request_id, order.block_size)
            for t in mine
        ]
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


def unshipped(
    out: PrefillOutput, start: int, end: int, past: PastLatents | None, skip: int
) -> tuple[list[Tensor], list[Tensor]]:
    """One prompt's latents from position `skip` (the decode group holds the rest) to its
    end, per layer. Its rows [start, end) of `out` are positions [P, N) after a cached prefix
    of P tokens; what the decode group lacks of that prefix comes from the cache."""
    hit = past.length if past is not None else 0
    if skip >= hit:
        lo = start + skip - hit
        return [n[lo:end] for n in out.n], [k[lo:end] for k in out.k_pe]
    assert past is not None
    return (
        [torch.cat([p[skip:], n[start:end]]) for p, n in zip(past.n, out.n, strict=True)],
        [torch.cat([p[skip:], k[start:end]]) for p, k in zip(past.k_pe, out.k_pe, strict=True)],
    )


def shifted(target: KvTargetInfo, skip: int) -> KvTargetInfo:
    """An SP target with its token ranges counted from prompt position `skip`."""
    if not target.token_ranges or not skip:
        return target
    ranges = tuple(max(x - skip, 0) for x in target.token_ranges)
    return dataclasses.replace(target, token_ranges=ranges)
