"""The receiving end of KV shard transfer: what every decode rank runs (`KvReceiverServicer`).

Both backends of `common.kv.transfer` land a shard in the rank's reserved blocks here, segment
by segment (`common.kv.wire`): runs of consecutive slots are received in place, scattered
blocks are staged and written while the next segment arrives.

* gRPC     `Push` takes the sender's chunk stream as raw bytes (`add_kv_receiver`) and spreads
           it over the segments (`_ByteFeed`); into a GPU pool through pinned host staging
           and asynchronous copies;
* torch    `ConnectTorch` joins a prefill worker's pair group (`common.kv.pair`: NCCL from
           GPU to GPU, else gloo; this rank is rank 0), then each `ExpectTorch` header
           announces one shard whose segments arrive point-to-point, on a GPU straight into
           the pool (or a device staging buffer and one scatter per segment).

On a GPU pool a shard's copies and scatters are queued on a stream of their own (not the
decode step's) and the receiver waits for them once, before it acknowledges the shard. A
shard that fails validation, arrives incomplete or misses its deadline is abandoned: its
reservation expires by the decode lease.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist
from torch import Tensor

from common.kv.epochs import BlockEpochs, StaleEpoch
from common.kv.framing import ROWS_FIELD, parse_chunk
from common.kv.paged_cache import PagedLatentCache
from common.kv.pair import (
    Pair,
    PairBackend,
    PairMaker,
    backend_key,
    choose_backend,
    settle_stream,
)
from common.kv.wire import (
    ShardWriter,
    StagingPool,
    TransferError,
    check_dtype,
    payload_bytes,
    row_bytes,
    shard_segments,
)
from common.rpc.auth import require_token
from common.rpc.gen import kv_pb2, kv_pb2_grpc

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class ShardTarget:
    """Where a validated shard goes: the rank's cache and each token's flat slot [N]."""

    cache: PagedLatentCache
    slots: Tensor
    # Called once the shard is in the cache, with the seconds spent writing it (metrics).
    written: Callable[[float], None] | None = None
    # The rank's block epochs: each segment lands only while the shard's epoch is its
    # blocks' live one (common/kv/epochs.py); None: unfenced.
    epochs: BlockEpochs | None = None


# Validates a shard's header against the rank (raising TransferError) and says where its rows
# go. The receiver writes them, possibly while later rows are still arriving.
Sink = Callable[[kv_pb2.KvHeader], ShardTarget]


class _Landing:
    """One shard on its way into the cache, as a list of segments to fill in order.

    The shard's segments, in place or staged and written as each one completes. Staged
    segments share one staging buffer on the transport's device (`recv_device`): each at its
    own offset if `whole` (torch posts every receive at once; copies into a GPU cache are
    asynchronous and read their staging later), else all at offset 0 (gRPC into a host cache
    fills one at a time and writes it before the next; a buffer that small stays in the CPU
    cache).
    """

    def __init__(
        self,
        header: kv_pb2.KvHeader,
        target: ShardTarget,
        pool: StagingPool,
        recv_device: torch.device,
        whole: bool,
        fenced_in_place: bool = True,
    ) -> None:
        """`fenced_in_place`: the transport's in-place receives can be fenced (gRPC copies
        them here, under the fence); else a fenced shard stages every segment."""
        self.header, self.target, self.pool = header, target, pool
        self.blocks = torch.tensor(list(header.block_ids), dtype=torch.int64)
        self.stale = False  # a segment was dropped: its epoch was no longer its blocks' own
        self.total = payload_bytes(header)
        cache_device = target.cache.kv.device
        # A GPU cache's writes go on a stream of their own: the decode step's stream must
        # not wait behind a transfer, nor the transfer behind steps.
        self.stream = torch.cuda.Stream(cache_device) if cache_device.type == "cuda" else None
        whole = whole or self.stream is not None
        with self.on_stream():
            cut = shard_segments(header, target.slots)
            self.writer = ShardWriter(target.cache, cut, check_dtype(header), recv_device)
        self.segments = self.writer.cut.segments
        self.sizes = [self.writer.nbytes(seg) for seg in self.segments]
        self._offsets: list[int | None] = []  # staging offset per segment; None: in place
        offset = 0
        in_place = fenced_in_place or target.epochs is None
        for seg, size in zip(self.segments, self.sizes, strict=True):
            if in_place and self.writer.in_place(seg):
                self._offsets.append(None)
                continue
            self._offsets.append(offset if whole else 0)
            offset = offset + size if whole else max(offset, size)
        pinned = recv_device.type == "cpu" and self.stream is not None
        self._staging = pool.take(offset, recv_device, pinned) if offset else None

    def on_stream(self) -> contextlib.AbstractContextManager[object]:
        """The context the shard's device work runs in (its stream on a GPU)."""
        return torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext()

    def buffer(self, index: int) -> Tensor:
        """The flat uint8 buffer segment `index` is received into."""
        offset = self._offsets[index]
        if offset is None:
            return self.writer.cache_bytes(self.segments[index])
        assert self._staging is not None
        return self._staging[offset : offset + self.sizes[index]]

    def in_place(self, index: int) -> bool:
        return self._offsets[index] is None

    @contextlib.contextmanager
    def fence(self) -> Iterator[bool]:
        """Whether the shard may write its blocks now, kept so inside the block."""
        epochs = self.target.epochs
        if epochs is None:
            yield True
            return
        with epochs.hold(self.blocks, self.header.epoch) as live:
            self.stale |= not live
            yield live

    def filled(self, index: int, buf: Tensor) -> None:
        """Segment `index` is complete in `buf`: write it, unless it landed in place (or
        its epoch is no longer its blocks' own)."""
        if self._offsets[index] is None:
            return
        with self.fence() as live, self.on_stream():
            if live:
                self.writer.write(self.segments[index], buf)
                if self.stream is not None and self.target.epochs is not None:
                    self.target.epochs.queued(self.stream)

    def close(self, complete: bool, deadline: float) -> None:
        """Wait for a complete shard's device work (once), release the staging buffer.

        An incomplete shard is abandoned: its reservation expires by lease. A stale one
        (its blocks given out again meanwhile) is counted and refused: StaleEpoch."""
        staging, self._staging = self._staging, None
        complete = complete and not self.stale
        try:
            if complete:
                settle_stream(self.stream, deadline)
        except BaseException:
            complete = False
            raise
        finally:
            if staging is not None:
                if complete or self.stream is None:
                    self.pool.give(staging)
                elif staging.is_cuda:
                    # Copies may still read it: the allocator frees it after the stream has.
                    staging.record_stream(self.stream)
                # (pinned host staging is dropped: torch frees it after its pending copies)
        if complete and self.target.written is not None:
            self.target.written(self.writer.seconds)
        if self.stale and self.target.epochs is not None:
            self.target.epochs.count_drop()
            raise StaleEpoch(
                f"request {self.header.request_id}: epoch {self.header.epoch} is no longer "
                "its blocks' (the reservation ended and its blocks were given out again)"
            )


class _ByteFeed:
    """Spreads a payload's byte stream (gRPC chunks of any size) over its segments' buffers."""

    def __init__(self, landing: _Landing) -> None:
        self.landing = landing
        self.received = 0
        self._index = 0
        self._filled = 0  # bytes of the current segment so far
        self._tensor: Tensor | None = None
        self._view: memoryview | None = None

    def feed(self, data: memoryview) -> None:
        if self.received + len(data) > self.landing.total:
            raise TransferError(f"got more than the {self.landing.total} bytes the header says")
        pos = 0
        while pos < len(data):  # bounded: every pass consumes bytes
            if self._view is None:
                self._tensor = self.landing.buffer(self._index)
                self._view, self._filled = memoryview(self._tensor.numpy()), 0
            take = min(len(data) - pos, len(self._view) - self._filled)
            if not self.landing.in_place(self._index):
                self._view[self._filled : self._filled + take] = data[pos : pos + take]
            else:  # straight into the cache: only while the blocks are the shard's own
                with self.landing.fence() as live:
                    if live:
                        self._view[self._filled : self._filled + take] = data[pos : pos + take]
            pos += take
            self._filled += take
            if self._filled == len(self._view):
                assert self._tensor is not None
                self.landing.filled(self._index, self._tensor)
                self._index += 1
                self._view = self._tensor = None
        self.received += len(data)


class KvReceiverServicer(kv_pb2_grpc.KvReceiverServicer):
    """Runs on each decode rank; `sink` validates a shard and says where it goes.

    `device` is the rank's cache device: it decides the torch pairs' backend. Register it with
    `add_kv_receiver`: `Push` takes its chunks as raw bytes.
    """

    def __init__(
        self,
        sink: Sink,
        torch_store: dist.TCPStore | None,
        token: str | None = None,
        timeout_s: float = 60.0,
        device: torch.device = _CPU,
    ) -> None:
        self.sink = sink
        self.store = torch_store
        self.token = token
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        self._pairs: dict[str, Pair] = {}
        self._maker = PairMaker()  # NCCL pairs: built on one thread (docs/design.md §5)
        self._locks: dict[str, threading.Lock] = {}
        self._pool = StagingPool()
        self.bytes_received = 0

    def _check(self, context: grpc.ServicerContext) -> None:
        require_token(context, self.token)

    def _deadline(self, context: grpc.ServicerContext | None) -> float:
        left = context.time_remaining() if context is not None else None
        return time.monotonic() + (self.timeout.total_seconds() if left is None else left)

    def _land(
        self, header: kv_pb2.KvHeader, recv_device: torch.device, whole: bool, grpc: bool
    ) -> _Landing:
        check_dtype(header)
        return _Landing(header, self.sink(header), self._pool, recv_device, whole, grpc)

    def Push(
        self, request_iterator: Iterator[bytes], context: grpc.ServicerContext
    ) -> kv_pb2.KvAck:
        self._check(context)
        try:
            received = self._push(request_iterator, self._deadline(context))
        except (TransferError, ValueError, RuntimeError) as exc:
            return kv_pb2.KvAck(ok=False, error=str(exc))
        self.bytes_received += received
        return kv_pb2.KvAck(ok=True, bytes=received)

    def _push(self, chunks: Iterator[bytes], deadline: float | None = None) -> int:
        deadline = self._deadline(None) if deadline is None else deadline
        landing: _Landing | None = None
        complete = False
        try:
            for raw in chunks:
                head, field_no, data = parse_chunk(raw)
                if landing is None:
                    if head is None:
                        raise TransferError("first chunk carries no header")
                    header = kv_pb2.KvHeader.FromString(head)
                    landing = self._land(header, _CPU, whole=False, grpc=True)
                    feed = _ByteFeed(landing)
                if len(data) and field_no != ROWS_FIELD:
                    raise TransferError(
                        f"payload in KvChunk field {field_no}, packed rows ride in {ROWS_FIELD}"
                    )
                feed.feed(data)
            if landing is None:
                raise TransferError("empty stream")
            if feed.received != landing.total:
                raise TransferError(f"got {feed.received} bytes, header says {landing.total}")
            complete = True
        finally:
            if landing is not None:
                landing.close(complete, deadline)
        return landing.total

    def ConnectTorch(
        self, request: kv_pb2.TorchPeer, context: grpc.ServicerContext
    ) -> kv_pb2.KvAck:
        self._check(context)
        if self.store is None:
            return kv_pb2.KvAck(ok=False, error="this rank has no torch transport")
        if request.peer not in self._pairs:
            try:
                offer = PairBackend(request.offer or PairBackend.GLOO)
            except ValueError:
                return kv_pb2.KvAck(ok=False, error=f"unknown pair backend {request.offer!r}")
            backend = choose_backend(offer, request.device_uuid, self.device)
            # The sender reads the choice before it builds its end of the group.
            self.store.set(backend_key(request.peer), backend.value)
            # The rendezvous blocks until the prefill worker joins as rank 1 of the pair.
            try:
                pair = self._maker.make(
                    self.store,
                    request.peer,
                    0,
                    backend,
                    self.device,
                    self.timeout,
                    self._deadline(context),
                )
            except TransferError as exc:
                return kv_pb2.KvAck(ok=False, error=str(exc))
            self._locks[request.peer] = threading.Lock()
            self._pairs[request.peer] = pair
        return kv_pb2.KvAck(ok=True)

    def ExpectTorch(self, request: kv_pb2.KvHeader, context: grpc.ServicerContext) -> kv_pb2.KvAck:
        self._check(context)
        pair = self._pairs.get(request.peer)
        if pair is None:
            error = f"unknown torch peer {request.peer!r}"
            return kv_pb2.KvAck(ok=False, error=error, pair_lost=True)
        deadline = self._deadline(context)
        try:
            # One transfer at a time per peer keeps the pair's messages matched.
            with self._locks[request.peer]:
                total = self._expect(pair, request, deadline)
        except (TransferError, ValueError, RuntimeError) as exc:
            return kv_pb2.KvAck(ok=False, error=str(exc), pair_lost=pair.broken)
        self.bytes_received += total
        return kv_pb2.KvAck(ok=True, bytes=total)

    def _expect(self, pair: Pair, header: kv_pb2.KvHeader, deadline: float) -> int:
        try:
            landing = self._land(header, pair.device, whole=True, grpc=False)
        except TransferError:  # refused: drained, the pair stays matched and in use
            try:
                _drain(pair, header, deadline)
            except BaseException:
                self._drop(pair)
                raise
            raise
        try:
            complete = False
            try:
                _recv_segments(pair, landing, deadline)
                complete = True
            finally:
                landing.close(complete, deadline)
        except StaleEpoch:
            raise  # every segment was received: the pair stays matched
        except BaseException:
            self._drop(pair)
            raise
        return landing.total

    def _drop(self, pair: Pair) -> None:
        """A transfer failed midway on `pair`: abort it; the sender builds a new pair, under
        a new name, for its next shard."""
        pair.fail()
        self._pairs.pop(pair.name, None)


def add_kv_receiver(servicer: KvReceiverServicer, server: grpc.Server) -> None:
    """Serve `KvReceiver` as the generated registration would, except that `Push` gets its
    chunks as raw bytes: `parse_chunk` reads the payload in place, protobuf would copy it."""
    service = kv_pb2.DESCRIPTOR.services_by_name["KvReceiver"].full_name
    ack = kv_pb2.KvAck.SerializeToString
    handlers = {
        "Push": grpc.stream_unary_rpc_method_handler(servicer.Push, response_serializer=ack),
        "ExpectTorch": grpc.unary_unary_rpc_method_handler(
            servicer.ExpectTorch, kv_pb2.KvHeader.FromString, ack
        ),
        "ConnectTorch": grpc.unary_unary_rpc_method_handler(
            servicer.ConnectTorch, kv_pb2.TorchPeer.FromString, ack
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))


def _drain(pair: Pair, header: kv_pb2.KvHeader, deadline: float) -> None:
    """Receive and drop a rejected shard's messages: its sender has posted them already, and
    left pending they would be matched by the pair's next transfer."""
    row = row_bytes(header)
    sizes = [(seg.stop - seg.start) * row for seg in shard_segments(header).segments]
    scratch = torch.empty(max(sizes, default=0), dtype=torch.uint8, device=pair.device)
    # One at a time into one scratch buffer: each receive completes before the next is posted.
    for tag, size in enumerate(sizes):
        pair.complete([pair.recv(scratch[:size], tag)], deadline)


def _recv_segments(pair: Pair, landing: _Landing, deadline: float) -> None:
    """Receive a packed payload's segments (tag = index), writing each as it completes.

    Every receive is posted first: gloo matches a message to a posted receive before it moves
    the bytes, and its IO thread keeps filling later segments while this one writes earlier
    ones. (Receiving a few segments ahead through a small reused ring measured slower: each
    late post costs the sender a round trip, and the ring's hand-offs cost CPU.) On NCCL the
    receives and the writes are only queued here, on the shard's stream; `_Landing.close`
    waits for them once.
    """
    with landing.on_stream():
        bufs = [landing.buffer(i) for i in range(len(landing.segments))]
        works = [pair.recv(buf, tag) for tag, buf in enumerate(bufs)]
        for index, (buf, work) in enumerate(zip(bufs, works, strict=True)):
            pair.wait(work, deadline)
            landing.filled(index, buf)
