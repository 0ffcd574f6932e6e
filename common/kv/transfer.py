"""KV shard transfer from prefill workers to decode ranks: one interface, two backends.

A shard is one rank's slice of one request's latent cache, layer-major and packed as the
cache stores it: kv [L, N, w + d_r], n and k_pe adjacent per token. Both backends land it in
the rank's reserved blocks through the same receiver (`KvReceiverServicer`), which every
decode rank runs, segment by segment (`common.kv.wire`): runs of consecutive slots are
received in place, scattered blocks are staged and written while the next segment arrives.

* `GrpcKvSender`   client-streams 1 MiB chunks (`KvReceiver.Push`);
* `TorchKvSender`  sends the segments point-to-point over a 2-rank gloo (NCCL on GPU) group
                   built once per (prefill worker, decode rank) pair from the rank's TCPStore,
                   so workers can join at any time; a small gRPC call carries the header.

The receiver still takes the older split layout (n [L, N, w] then k_pe [L, N, d_r]), so
senders that predate packed shards keep working.

Every transfer has a deadline; a failed one leaves its reservation to the decode lease.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist
from torch import Tensor

from common.kv.paged_cache import PagedLatentCache
from common.kv.wire import RowPlan, ShardWriter, StagingPool, plan_segments
from common.rpc.auth import require_token
from common.rpc.clients import CHANNEL_OPTIONS, TOKEN_METADATA_KEY
from common.rpc.convert import KvTargetInfo
from common.rpc.gen import kv_pb2, kv_pb2_grpc

CHUNK_BYTES = 2**20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TransferError(RuntimeError):
    pass


@dataclass(frozen=True)
class Shard:
    """One rank's part of a request's cache, and where it goes."""

    request_id: str
    rank: int
    kv: Tensor  # [L, N, w + d_r], contiguous: what goes on the wire
    latent_width: int  # w
    block_size: int
    block_ids: tuple[int, ...]
    positions: tuple[int, ...] = ()  # empty: token positions 0..N-1

    @classmethod
    def from_parts(
        cls,
        request_id: str,
        rank: int,
        n: Tensor,
        k_pe: Tensor,
        block_size: int,
        block_ids: tuple[int, ...],
        positions: tuple[int, ...] = (),
    ) -> Shard:
        """A shard from n [L, N, w] and k_pe [L, N, d_r] (one copy, to pack them)."""
        kv = torch.cat([n, k_pe], dim=-1).contiguous()
        return cls(request_id, rank, kv, n.shape[2], block_size, block_ids, positions)

    @property
    def n(self) -> Tensor:
        return self.kv[..., : self.latent_width]

    @property
    def k_pe(self) -> Tensor:
        return self.kv[..., self.latent_width :]

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    def header(self, peer: str = "") -> kv_pb2.KvHeader:
        dtype = next(k for k, v in DTYPES.items() if v == self.kv.dtype)
        return kv_pb2.KvHeader(
            request_id=self.request_id,
            rank=self.rank,
            num_layers=self.kv.shape[0],
            num_tokens=self.kv.shape[1],
            latent_width=self.latent_width,
            rope_width=self.kv.shape[2] - self.latent_width,
            dtype=dtype,
            block_size=self.block_size,
            block_ids=list(self.block_ids),
            positions=list(self.positions),
            peer=peer,
            layout=kv_pb2.KV_LAYOUT_PACKED,
        )


def cut_shard(
    n_layers: list[Tensor],
    k_pe_layers: list[Tensor],
    start: int,
    end: int,
    target: KvTargetInfo,
    request_id: str,
    block_size: int,
) -> Shard:
    """The part of one prompt's packed latents [start, end) that `target` caches.

    TPLA / MLA-TP: every token, the target's latent columns. SP: the target's token chunks
    (`token_ranges`, prompt positions) at full width, in the rank's contiguous local order.
    """
    w = target.latent_width
    cols = slice(target.latent_start, target.latent_start + w)
    rows: Tensor | slice
    if target.token_ranges:
        pairs = zip(target.token_ranges[::2], target.token_ranges[1::2], strict=True)
        rows = (
            torch.tensor(
                [p for lo, hi in pairs for p in range(lo, min(hi, end - start))], dtype=torch.long
            )
            + start
        )
        tokens = len(rows)
    else:
        rows, tokens = slice(start, end), end - start
    # Packed straight from the prefill output: the cut is the only copy before the wire.
    d_r = k_pe_layers[0].shape[1]
    kv = torch.empty(len(n_layers), tokens, w + d_r, dtype=n_layers[0].dtype)
    for layer, (n, k_pe) in enumerate(zip(n_layers, k_pe_layers, strict=True)):
        kv[layer, :, :w] = n[rows, cols]
        kv[layer, :, w:] = k_pe[rows]
    return Shard(request_id, target.rank, kv, w, block_size, target.block_ids)


def shard_slots(header: kv_pb2.KvHeader) -> Tensor:
    """Flat cache slots of the shard's tokens, from its block table."""
    positions = (
        torch.tensor(list(header.positions), dtype=torch.int64)
        if header.positions
        else torch.arange(header.num_tokens)
    )
    blocks = torch.tensor(list(header.block_ids), dtype=torch.int64)
    index = positions // header.block_size
    if len(positions) and int(index.max()) >= len(blocks):
        raise TransferError(
            f"shard of {header.num_tokens} tokens overflows its {len(blocks)} reserved blocks"
        )
    return blocks[index] * header.block_size + positions % header.block_size


def _check_dtype(h: kv_pb2.KvHeader) -> torch.dtype:
    if h.dtype not in DTYPES:
        raise TransferError(f"unknown dtype {h.dtype!r}")
    return DTYPES[h.dtype]


def _row_bytes(h: kv_pb2.KvHeader) -> int:
    """Bytes of one token of one layer (n and k_pe) on the wire."""
    item = torch.empty((), dtype=_check_dtype(h)).element_size()
    return (h.latent_width + h.rope_width) * item


def _payload_bytes(h: kv_pb2.KvHeader) -> int:
    return h.num_layers * h.num_tokens * _row_bytes(h)


def _split_views(h: kv_pb2.KvHeader, raw: Tensor) -> tuple[Tensor, Tensor]:
    """n [L, N, w] and k_pe [L, N, d_r] of a split-layout payload in a flat byte buffer."""
    dt, tokens = _check_dtype(h), h.num_layers * h.num_tokens
    n_bytes = tokens * h.latent_width * (_row_bytes(h) // (h.latent_width + h.rope_width))
    n = raw[:n_bytes].view(dt).view(h.num_layers, h.num_tokens, h.latent_width)
    k_pe = raw[n_bytes : _payload_bytes(h)].view(dt).view(h.num_layers, h.num_tokens, h.rope_width)
    return n, k_pe


def row_plan(h: kv_pb2.KvHeader, slots: Tensor | None = None) -> RowPlan:
    """The segments of a packed payload with header `h`, as both ends cut it."""
    slots = shard_slots(h) if slots is None else slots
    return plan_segments(h.num_layers, slots, h.block_size, bool(h.positions), _row_bytes(h))


# -- receiver ------------------------------------------------------------------------------------


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
        self.total = _payload_bytes(header)
        self.packed = header.layout == kv_pb2.KV_LAYOUT_PACKED
        self._offsets: list[int | None] = []  # staging offset per segment; None: in place
        if self.packed:
            plan = row_plan(header, target.slots)
            self.writer = ShardWriter(target.cache, plan, _check_dtype(header))
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
        return _split_views(self.header, self.buffer(0))

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
        _check_dtype(header)
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
    row = _row_bytes(header)
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


# -- senders -------------------------------------------------------------------------------------


class KvSender(abc.ABC):
    name: str

    @abc.abstractmethod
    def send(self, shard: Shard, grpc_address: str, torch_address: str, deadline_s: float) -> int:
        """Deliver one shard; returns bytes sent. Raises TransferError on failure."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


@dataclass
class _Channels:
    token: str | None
    stubs: dict[str, kv_pb2_grpc.KvReceiverStub] = field(default_factory=dict)
    pushes: dict[str, grpc.StreamUnaryMultiCallable] = field(default_factory=dict)
    channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def _channel(self, address: str) -> grpc.Channel:
        if address not in self.channels:
            self.channels[address] = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        return self.channels[address]

    def stub(self, address: str) -> kv_pb2_grpc.KvReceiverStub:
        if address not in self.stubs:
            self.stubs[address] = kv_pb2_grpc.KvReceiverStub(self._channel(address))
        return self.stubs[address]

    def push(self, address: str) -> grpc.StreamUnaryMultiCallable:
        """`KvReceiver.Push` taking pre-serialized chunks (see `encode_chunks`)."""
        if address not in self.pushes:
            self.pushes[address] = self._channel(address).stream_unary(
                _PUSH_METHOD, request_serializer=None, response_deserializer=kv_pb2.KvAck.FromString
            )
        return self.pushes[address]

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_METADATA_KEY, self.token),) if self.token else ()

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()


def _ack(ack: kv_pb2.KvAck, shard: Shard) -> int:
    if not ack.ok:
        raise TransferError(
            f"rank {shard.rank} rejected the shard of {shard.request_id}: {ack.error}"
        )
    return int(ack.bytes)


_PUSH_METHOD = "/{}/Push".format(kv_pb2.DESCRIPTOR.services_by_name["KvReceiver"].full_name)
_ROWS_TAG = b"\x1a"  # KvChunk.rows: field 3, length-delimited (a packed payload)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_chunks(shard: Shard, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The shard as serialized `KvChunk` messages, built straight from a view of its rows.

    Wire-identical to `KvChunk(header=..., rows=...).SerializeToString()`, but each chunk
    costs one copy: constructing the message copies the payload and serializing copies it
    again, and in a sender whose GIL drives every rank's stream those copies are the cost.
    """
    header = shard.header().SerializeToString()
    head = b"\x0a" + _varint(len(header)) + header  # KvChunk.header: field 1
    view = memoryview(shard.kv.contiguous().view(-1).view(torch.uint8).numpy())
    for start in range(0, len(view), chunk_bytes):
        data = view[start : start + chunk_bytes]
        prefix = _ROWS_TAG + _varint(len(data))
        yield b"".join((head, prefix, data) if start == 0 else (prefix, data))
    if not len(view):  # an empty shard still announces itself
        yield head


class GrpcKvSender(KvSender):
    name = "grpc"

    def __init__(self, token: str | None = None) -> None:
        self._ch = _Channels(token)

    def send(self, shard: Shard, grpc_address: str, torch_address: str, deadline_s: float) -> int:
        try:
            ack = self._ch.push(grpc_address)(
                encode_chunks(shard), timeout=deadline_s, metadata=self._ch.metadata
            )
        except grpc.RpcError as exc:
            raise TransferError(
                f"KV push to rank {shard.rank} at {grpc_address} failed: {exc.code().name}"
            ) from exc
        return _ack(ack, shard)

    def close(self) -> None:
        self._ch.close()


class TorchKvSender(KvSender):
    """Point-to-point tensors over one 2-rank group per decode rank (this worker is rank 1)."""

    name = "torch"

    def __init__(self, worker_id: str, token: str | None = None, timeout_s: float = 60.0) -> None:
        self.worker_id = worker_id
        self._ch = _Channels(token)
        self.timeout = timedelta(seconds=timeout_s)
        self._groups: dict[str, dist.ProcessGroup] = {}
        # One transfer at a time per decode rank keeps that pair's tags ordered; shards for
        # different ranks travel in parallel (a worker-wide lock serialized them).
        self._pair_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()  # guards the lock table

    def _pair_lock(self, torch_address: str) -> threading.Lock:
        with self._lock:
            return self._pair_locks.setdefault(torch_address, threading.Lock())

    def _group(
        self, grpc_address: str, torch_address: str, deadline_s: float
    ) -> tuple[dist.ProcessGroup, str]:
        peer = f"{self.worker_id}->{torch_address}"
        if torch_address not in self._groups:
            host, port = torch_address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False, timeout=self.timeout)
            connect = self._ch.stub(grpc_address).ConnectTorch.future(
                kv_pb2.TorchPeer(peer=peer), timeout=deadline_s, metadata=self._ch.metadata
            )
            group = dist.ProcessGroupGloo(dist.PrefixStore(peer, store), 1, 2, self.timeout)
            ack = connect.result()
            if not ack.ok:
                raise TransferError(f"torch pair with {torch_address} refused: {ack.error}")
            self._groups[torch_address] = group
        return self._groups[torch_address], peer

    def send(self, shard: Shard, grpc_address: str, torch_address: str, deadline_s: float) -> int:
        if not torch_address:
            raise TransferError(f"rank {shard.rank} offers no torch transport address")
        start = time.monotonic()
        try:
            with self._pair_lock(torch_address):
                group, peer = self._group(grpc_address, torch_address, deadline_s)
                left = max(deadline_s - (time.monotonic() - start), 1.0)
                header = shard.header(peer)
                ack_future = self._ch.stub(grpc_address).ExpectTorch.future(
                    header, timeout=left, metadata=self._ch.metadata
                )
                # Every segment is posted at once: the receiver matches them as it posts its
                # receives, and the bytes move while it writes earlier segments.
                payload = shard.kv.contiguous().view(-1).view(torch.uint8)
                row = _row_bytes(header)
                sends = [
                    group.send([payload[seg.start * row : seg.stop * row]], 0, tag)
                    for tag, seg in enumerate(row_plan(header).segments)
                ]
                for work in sends:
                    work.wait()
                ack = ack_future.result()
        except grpc.RpcError as exc:
            raise TransferError(
                f"torch KV transfer to rank {shard.rank} failed: {exc.code().name}"
            ) from exc
        except RuntimeError as exc:  # gloo errors (peer gone, timeout)
            raise TransferError(f"torch KV transfer to rank {shard.rank} failed: {exc}") from exc
        return _ack(ack, shard)

    def close(self) -> None:
        self._ch.close()
        self._groups.clear()


def make_sender(name: str, worker_id: str, token: str | None = None) -> KvSender:
    if name == "grpc":
        return GrpcKvSender(token)
    if name == "torch":
        return TorchKvSender(worker_id, token)
    raise ValueError(f"unknown KV transport {name!r} (grpc, torch)")
