"""The torch transport's link between one prefill worker and one decode rank.

Each (prefill worker, decode rank) pair is a 2-rank process group of its own, built from the
decode rank's TCPStore under the pair's name (the receiver is rank 0, the sender rank 1). Not
`new_group` on a shared world: a world has a fixed membership set at start-up, while prefill
workers start, stop and scale independently of the decode groups, and a rank that died would
take every other pair of that world with it. A pair group joins and fails alone.

The pair runs NCCL when both ends hold their bytes on distinct CUDA devices (the shard goes
from the prefill GPU straight into the decode GPU, no host copy), gloo otherwise (CPU tensors;
a CUDA end stages through host memory). The receiver decides, from the sender's offer and its
own cache device, and publishes the choice in the store before either end builds the group.

Waiting is the one place the backends differ: a gloo wait blocks the host until the bytes are
there; an NCCL wait only orders the caller's CUDA stream after the transfer, and `complete`
(or `settle_stream`, for the writes queued behind the receives) polls for completion against
the transfer's deadline, so a dead peer costs a deadline, never a
hung thread. A pair whose transfer failed midway is aborted and rebuilt, never reused.

An NCCL pair shares its GPU with the rank's data group (docs/design.md §5, "NCCL
communicators on one GPU"): every NCCL pair of a process is created by one thread, its
`PairMaker`, with its communicator connected there and then (not lazily by a shard's first
send on whichever thread carries it); its sends and receives are launched in the device's
launch order (common/runtime/launch_order.py), which the data group's collectives share, on
streams of their own, never the step's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from enum import StrEnum

import torch
import torch.distributed as dist
from torch import Tensor

from common.kv.wire import TransferError
from common.runtime.launch_order import launch_order

# Past the transfer deadlines (which fail a transfer first, by polling): NCCL's own watchdog
# must never be what notices a dead peer, since by default it tears the process down.
NCCL_WATCHDOG = timedelta(minutes=30)
_POLL_S = 0.0002  # a device event: a local query, cheap to repeat


class PairBackend(StrEnum):
    GLOO = "gloo"
    NCCL = "nccl"


def device_uuid(device: torch.device) -> str:
    """A CUDA device's identity across processes (its index differs under
    CUDA_VISIBLE_DEVICES); empty for the CPU."""
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def choose_backend(offer: PairBackend, sender_uuid: str, receiver: torch.device) -> PairBackend:
    """The receiver's choice for a pair: NCCL only when the sender offers it (its shards are
    on a GPU) and the receiver's cache is on another GPU (NCCL refuses two ranks of one
    communicator on one device: a prefill worker sharing the decode rank's GPU uses gloo)."""
    distinct_gpus = receiver.type == "cuda" and sender_uuid not in ("", device_uuid(receiver))
    return PairBackend.NCCL if offer is PairBackend.NCCL and distinct_gpus else PairBackend.GLOO


def backend_key(name: str) -> str:
    """The store key of a pair's backend (outside the pair's own key prefix)."""
    return f"tpla-pair-backend/{name}"


class Pair:
    """One end of a pair group; `device` is where its send and receive buffers live."""

    def __init__(
        self,
        store: dist.Store,
        name: str,
        rank: int,
        backend: PairBackend,
        device: torch.device,
        timeout: timedelta,
    ) -> None:
        self.name, self.rank, self.backend = name, rank, backend
        self.peer = 1 - rank
        self.broken = False
        prefixed = dist.PrefixStore(name, store)
        if backend is PairBackend.NCCL:
            assert device.type == "cuda", "an NCCL pair moves CUDA tensors"
            self.device = device
            self.group = _nccl_group(prefixed, rank, device)
        else:
            # Gloo's constructor blocks until both ends joined (the rendezvous).
            self.device = torch.device("cpu")
            self.group = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)

    def send(self, buf: Tensor, tag: int) -> dist.Work:
        with launch_order(self.device):
            return self.group.send([buf], self.peer, tag)

    def recv(self, buf: Tensor, tag: int) -> dist.Work:
        """Post a receive. NCCL ignores tags and matches in posting order, which the pair's
        lock keeps equal at both ends."""
        with launch_order(self.device):
            return self.group.recv([buf], self.peer, tag)

    def wait(self, work: dist.Work, deadline: float) -> None:
        """Gloo: block until `work` is done (at most until `deadline`, monotonic). NCCL: order
        the current CUDA stream after it, without blocking the host."""
        if self.backend is PairBackend.NCCL:
            work.wait()
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferError("the transfer's deadline passed")
        work.wait(timedelta(seconds=left))

    def complete(self, works: list[dist.Work], deadline: float) -> None:
        """Block until every one of `works` finished on its device, or fail at `deadline`.

        NCCL polls the works' completion events (host polling, not a stream sync: the
        caller's stream may hold unrelated later work)."""
        if self.backend is PairBackend.NCCL:
            poll_until(lambda: all(w.is_completed() for w in works), deadline)
            return
        for work in works:
            self.wait(work, deadline)

    def fail(self) -> None:
        """The transfer failed midway (a deadline, the peer gone): the pair may hold
        unmatched messages, so it is never reused. Aborted here (its pending operations end
        at once, at both ends), it is replaced by a new pair, under a new name, for the next
        shard; the peer drops its end when its own operations fail."""
        if not self.broken:
            self.broken = True
            self.group.abort()


def poll_until(done: Callable[[], bool], deadline: float, interval_s: float = _POLL_S) -> None:
    """Poll `done()` until it is true; TransferError at `deadline` (monotonic)."""
    while not done():  # bounded by the deadline
        if time.monotonic() > deadline:
            raise TransferError("the transfer's deadline passed before it completed")
        time.sleep(interval_s)


def settle_stream(stream: torch.cuda.Stream | None, deadline: float) -> None:
    """Wait for everything queued on `stream` so far (None: nothing to wait for), polling
    against `deadline`: the one host wait a shard's device copies cost."""
    if stream is None:
        return
    event = torch.cuda.Event()
    event.record(stream)
    poll_until(event.query, deadline)


def _nccl_group(store: dist.Store, rank: int, device: torch.device) -> dist.ProcessGroup:
    """A 2-rank NCCL group with its communicator connected now (both ends connect as they
    build their end: the pair's rendezvous). Outside the device's launch order: the connect
    waits for the peer, and the data group's launches must not wait with it."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = NCCL_WATCHDOG
    with torch.cuda.device(device):
        group = dist.ProcessGroupNCCL(store, rank, 2, options)
        group.eager_connect_single_device(device)
    return group


class PairMaker:
    """The one thread that builds an owner's NCCL pairs, in the order they are asked for: so
    communicators are never created by two threads at once, nor by a thread that carries a
    shard (docs/design.md §5). A gloo pair has no device to order and is built on the
    caller's thread (its rendezvous blocks there, as before). A pair whose building outlives
    the caller's deadline fails the caller; the thread goes on to the next pair when that
    one's rendezvous ends, and aborts it."""

    def __init__(self) -> None:
        self._thread: ThreadPoolExecutor | None = None  # made with the first NCCL pair

    def make(
        self,
        store: dist.Store,
        name: str,
        rank: int,
        backend: PairBackend,
        device: torch.device,
        timeout: timedelta,
        deadline: float,
    ) -> Pair:
        """`Pair(...)`, an NCCL one built on the maker's thread; TransferError past
        `deadline`."""
        if backend is not PairBackend.NCCL:
            return Pair(store, name, rank, backend, device, timeout)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-pairs")
        built = self._thread.submit(Pair, store, name, rank, backend, device, timeout)
        try:
            return built.result(timeout=max(deadline - time.monotonic(), 0.0))
        except FutureTimeout:
            built.add_done_callback(lambda f: f.exception() is None and f.result().fail())
            raise TransferError(f"pair {name} was not built by the deadline") from None

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
