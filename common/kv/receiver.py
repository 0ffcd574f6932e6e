"""The receiving end of KV shard transfer: what every decode rank runs (`KvReceiverServicer`).

Both backends of `common.kv.transfer` land a shard in the rank's reserved blocks here, segment
by segment (`common.kv.wire`): runs of consecutive slots are received in place, scattered
blocks are staged and written while the next segment arrives.

* gRPC     `Push` takes the sender's chunk stream as raw bytes (`add_kv_receiver`) and spreads
           it over the segments (`_ByteFeed`);
* torch    `ConnectTorch` joins a prefill worker's 2-rank group (this rank is rank 0), then
           each `ExpectTorch` header announces one shard whose segments arrive point-to-point.

The receiver still takes the older split layout (n [L, N, w] then k_pe [L, N, d_r]), so
senders that predate packed shards keep working. A shard that fails validation or arrives
incomplete is abandoned: its reservation expires by the decode lease.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist
from torch import Tensor

from common.kv.paged_cache import PagedLatentCache
from common.kv.wire import (
    ShardWriter,
    StagingPool,
    TransferError,
    check_dtype,
    payload_bytes,
    row_bytes,
    row_plan,
    split_views,
)
from common.rpc.auth import require_token
from common.rpc.gen import kv_pb2, kv_pb2_grpc


@dataclass(frozen=True)
class ShardTarget:
    """Where a validated shard goes: the rank's cache and each token's flat slot [N]."""

    cache: PagedLatentCache
    slots: Tensor
    # Called once the shard is in the cache, with the seconds spent writing it (metrics).
    written: Callable[[float], None] | None = None


# Validates a shard's header against the rank (raising TransferError) and says where its rows
# go. The receiver writes them, possibly while later rows are still arriving.
Sink = Callable[[kv_pb2.KvHeader], ShardTarget]


class _Landing:
    """One shard on its way into the cache, as a list of segments to fill in order.

    Packed: the plan's segments, in place or staged and written as each one completes.
    Staged segments share one staging buffer: each at its own offset if `whole` (torch posts
    every receive at once), else all at offset 0 (gRPC fills one at a time and writes it
    before the next; a buffer that small stays in the CPU cache). Split (older senders): one
    segment, the whole payload, written when it is complete.
    """

    def __init__(
        self, header: kv_pb2.KvHeader, target: ShardTarget, pool: StagingPool, whole: bool
    ) -> None:
        self.header, self.target, self.pool = header, target, pool
        self.total = payload_bytes(header)
        self.packed = header.layout == kv_pb2.KV_LAYOUT_PACKED
        self._offsets: list[int | None] = []  # staging offset per segment; None: in place
        if self.packed:
            plan = row_plan(header, target.slots)
            self.writer = ShardWriter(target.cache, plan, check_dtype(header))
            self.segments = self.writer.plan.segments
            self.sizes = [self.writer.nbytes(seg) for seg in self.segments]
            offset = 0
            for seg, size in zip(self.segments, self.sizes, strict=True):
                if self.writer.in_place(seg):
                    self._offsets.append(None)
                    continue
                self._offsets.append(offset if whole else 0)
                offset = offset + size if whole else max(offset, size)
            staging_bytes = offset
        else:
            self.sizes = [self.total]
            self._offsets = [0]
            staging_bytes = self.total
        self._staging = pool.take(staging_bytes) if staging_bytes else None

    def buffer(self, index: int) -> Tensor:
        """The flat uint8 buffer segment `index` is received into."""
        offset = self._offsets[index]
        if offset is None:
            return self.writer.cache_bytes(self.segments[index])
        assert self._staging is not None
        return self._staging[offset : offset + self.sizes[index]]

    def filled(self, index: int, buf: Tensor) -> None:
        """Segment `index` is complete in `buf`: write it, unless it landed in place."""
        if self.packed and self._offsets[index] is not None:
            self.writer.write(self.segments[index], buf)

    def split_buffers(self) -> tuple[Tensor, Tensor]:
        return split_views(self.header, self.buffer(0))

    def close(self, complete: bool) -> None:
        """Finish the write of a complete shard and release the staging buffer.

        An incomplete shard is abandoned: its reservation expires by lease."""
        try:
            if complete and not self.packed:
                t0 = time.perf_counter()
                n, k_pe = self.split_buffers()
                self.target.cache.write_all_layers(self.target.slots, n, k_pe)
                seconds = time.perf_counter() - t0
            elif complete:
                seconds = self.writer.seconds
        finally:
            if self._staging is not None:
                self.pool.give(self._staging)
                self._staging = None
        if complete and self.target.written is not None:
            self.target.written(seconds)


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
            self._view[self._filled : self._filled + take] = data[pos : pos + take]
            pos += take
            self._filled += take
            if self._filled == len(self._view):
                assert self._tensor is not None
                self.landing.filled(self._index, self._tensor)
                self._index += 1
                self._view = self._tensor = None
        self.received += len(data)


def parse_chunk(raw: bytes) -> tuple[bytes | None, int, memoryview]:
    """A serialized `KvChunk` read without protobuf: (serialized header or None, payload field
    number (0: none), payload as a view of `raw`). Protobuf would copy the payload twice."""
    view = memoryview(raw)
    header: list[bytes] = []
    field_no, payload = 0, view[:0]
    pos = 0
    while pos < len(view):  # bounded: every field advances pos
        key, pos = _read_varint(view, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _read_varint(view, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            length, pos = _read_varint(view, pos)
            if pos + length > len(view):
                raise TransferError("truncated KvChunk")
            if number == 1:  # repeated occurrences of a message field merge
                header.append(bytes(view[pos : pos + length]))
            elif number in (2, 3):
                field_no, payload = number, view[pos : pos + length]
            pos += length
        else:
            raise TransferError(f"unsupported wire type {wire_type} in KvChunk")
    if pos != len(view):
        raise TransferError("truncated KvChunk")
    return (b"".join(header) if header else None), field_no, payload


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    for _ in range(10):  # a varint has at most 10 bytes
        if pos >= len(view):
            raise TransferError("truncated KvChunk")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise TransferError("malformed varint in KvChunk")


class KvReceiverServicer(kv_pb2_grpc.KvReceiverServicer):
    """Runs on each decode rank; `sink` validates a shard and says where it goes.

    Register it with `add_kv_receiver`: `Push` takes its chunks as raw bytes.
    """

    def __init__(
        self,
        sink: Sink,
        torch_store: dist.TCPStore | None,
        token: str | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.sink = sink
        self.store = torch_store
        self.token = token
        self.timeout = timedelta(seconds=timeout_s)
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._pool = StagingPool()
        self.bytes_received = 0

    def _check(self, context: grpc.ServicerContext) -> None:
        require_token(context, self.token)

    def _land(self, header: kv_pb2.KvHeader, whole: bool) -> _Landing:
        if header.layout not in (kv_pb2.KV_LAYOUT_SPLIT, kv_pb2.KV_LAYOUT_PACKED):
            raise TransferError(f"unknown KV layout {header.layout}")
        check_dtype(header)
        return _Landing(header, self.sink(header), self._pool, whole)

    def Push(
        self, request_iterator: Iterator[bytes], context: grpc.ServicerContext
    ) -> kv_pb2.KvAck:
        self._check(context)
        try:
            received = self._push(request_iterator)
        except (TransferError, ValueError, RuntimeError) as exc:
            return kv_pb2.KvAck(ok=False, error=str(exc))
        self.bytes_received += received
        return kv_pb2.KvAck(ok=True, bytes=received)

    def _push(self, chunks: Iterator[bytes]) -> int:
        landing: _Landing | None = None
        complete = False
        try:
            for raw in chunks:
                head, field_no, data = parse_chunk(raw)
                if landing is None:
                    if head is None:
                        raise TransferError("first chunk carries no header")
                    landing = self._land(kv_pb2.KvHeader.FromString(head), whole=False)
                    feed = _ByteFeed(landing)
                    want = 3 if landing.packed else 2  # KvChunk.rows / KvChunk.data
                if len(data) and field_no != want:
                    raise TransferError(f"payload in KvChunk field {field_no}, layout needs {want}")
                feed.feed(data)
            if landing is None:
                raise TransferError("empty stream")
            if feed.received != landing.total:
                raise TransferError(f"got {feed.received} bytes, header says {landing.total}")
            complete = True
        finally:
            if landing is not None:
                landing.close(complete)
        return landing.total

    def ConnectTorch(
        self, request: kv_pb2.TorchPeer, context: grpc.ServicerContext
    ) -> kv_pb2.KvAck:
        self._check(context)
        if self.store is None:
            return kv_pb2.KvAck(ok=False, error="this rank has no torch transport")
        if request.peer not in self._groups:
            # Blocks until the prefill worker joins as rank 1 of the pair.
            self._groups[request.peer] = dist.ProcessGroupGloo(
                dist.PrefixStore(request.peer, self.store), 0, 2, self.timeout
            )
            self._locks[request.peer] = threading.Lock()
        return kv_pb2.KvAck(ok=True)

    def ExpectTorch(self, request: kv_pb2.KvHeader, context: grpc.ServicerContext) -> kv_pb2.KvAck:
        self._check(context)
        group = self._groups.get(request.peer)
        if group is None:
            return kv_pb2.KvAck(ok=False, error=f"unknown torch peer {request.peer!r}")
        try:
            # One transfer at a time per peer keeps the pair's tags matched.
            with self._locks[request.peer]:
                try:
                    landing = self._land(request, whole=True)
                except TransferError:
                    _drain(group, request)
                    raise
                complete = False
                try:
                    if landing.packed:
                        _recv_segments(group, landing)
                    else:
                        n, k_pe = landing.split_buffers()
                        group.recv([n], 1, 0).wait()
                        group.recv([k_pe], 1, 1).wait()
                    complete = True
                finally:
                    landing.close(complete)
        except (TransferError, ValueError, RuntimeError) as exc:
            return kv_pb2.KvAck(ok=False, error=str(exc))
        self.bytes_received += landing.total
        return kv_pb2.KvAck(ok=True, bytes=landing.total)


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


def _drain(group: dist.ProcessGroup, header: kv_pb2.KvHeader) -> None:
    """Receive and drop a rejected shard's messages: its sender has posted them already, and
    left pending they would be matched by the pair's next transfer, which reuses the tags."""
    row = row_bytes(header)
    if header.layout == kv_pb2.KV_LAYOUT_PACKED:
        sizes = [(seg.stop - seg.start) * row for seg in row_plan(header).segments]
    else:
        tokens = header.num_layers * header.num_tokens
        sizes = [tokens * row * header.latent_width // (header.latent_width + header.rope_width)]
        sizes.append(tokens * row - sizes[0])
    scratch = torch.empty(max(sizes, default=0), dtype=torch.uint8)
    for tag, size in enumerate(sizes):
        group.recv([scratch[:size]], 1, tag).wait()


def _recv_segments(group: dist.ProcessGroup, landing: _Landing) -> None:
    """Receive a packed payload's segments (tag = index), writing each as it completes.

    Every receive is posted first: gloo matches a message to a posted receive before it moves
    the bytes, and its IO thread keeps filling later segments while this one writes earlier
    ones. (Receiving a few segments ahead through a small reused ring measured slower: each
    late post costs the sender a round trip, and the ring's hand-offs cost CPU.)
    """
    bufs = [landing.buffer(i) for i in range(len(landing.segments))]
    works = [group.recv([buf], 1, tag) for tag, buf in enumerate(bufs)]
    for index, (buf, work) in enumerate(zip(bufs, works, strict=True)):
        work.wait()
        landing.filled(index, buf)
