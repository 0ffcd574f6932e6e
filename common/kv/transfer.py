"""KV shard transfer from prefill workers to decode ranks: one interface, two backends.

A shard is one rank's slice of one request's latent cache, layer-major: n [L, N, w] and
k_pe [L, N, d_r]. Both backends land it in the rank's reserved blocks through the same
receiver (`KvReceiverServicer`), which every decode rank runs:

* `GrpcKvSender`   client-streams 1 MiB chunks (`KvReceiver.Push`);
* `TorchKvSender`  sends the tensors point-to-point over a 2-rank gloo (NCCL on GPU) group
                   built once per (prefill worker, decode rank) pair from the rank's TCPStore,
                   so workers can join at any time; a small gRPC call carries the header.

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
    n: Tensor  # [L, N, w]
    k_pe: Tensor  # [L, N, d_r]
    block_size: int
    block_ids: tuple[int, ...]
    positions: tuple[int, ...] = ()  # empty: token positions 0..N-1

    @property
    def nbytes(self) -> int:
        return self.n.nbytes + self.k_pe.nbytes

    def header(self, peer: str = "") -> kv_pb2.KvHeader:
        dtype = next(k for k, v in DTYPES.items() if v == self.n.dtype)
        return kv_pb2.KvHeader(
            request_id=self.request_id,
            rank=self.rank,
            num_layers=self.n.shape[0],
            num_tokens=self.n.shape[1],
            latent_width=self.n.shape[2],
            rope_width=self.k_pe.shape[2],
            dtype=dtype,
            block_size=self.block_size,
            block_ids=list(self.block_ids),
            positions=list(self.positions),
            peer=peer,
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
    cols = slice(target.latent_start, target.latent_start + target.latent_width)
    if target.token_ranges:
        pairs = zip(target.token_ranges[::2], target.token_ranges[1::2], strict=True)
        index = (
            torch.tensor(
                [p for lo, hi in pairs for p in range(lo, min(hi, end - start))], dtype=torch.long
            )
            + start
        )
    else:
        index = torch.arange(start, end)
    n = torch.stack([layer[index][:, cols] for layer in n_layers])
    k_pe = torch.stack([layer[index] for layer in k_pe_layers])
    return Shard(
        request_id, target.rank, n.contiguous(), k_pe.contiguous(), block_size, target.block_ids
    )


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


def _payload_bytes(h: kv_pb2.KvHeader) -> tuple[int, int]:
    """Bytes of n and of k_pe that a shard with header `h` carries."""
    item = torch.empty((), dtype=_check_dtype(h)).element_size()
    tokens = h.num_layers * h.num_tokens
    return tokens * h.latent_width * item, tokens * h.rope_width * item


def _views(h: kv_pb2.KvHeader, raw: Tensor) -> tuple[Tensor, Tensor]:
    """n [L, N, w] and k_pe [L, N, d_r] as views of a flat byte buffer (no copy)."""
    n_bytes, k_bytes = _payload_bytes(h)
    dt = _check_dtype(h)
    n = raw[:n_bytes].view(dt).view(h.num_layers, h.num_tokens, h.latent_width)
    k_pe = raw[n_bytes : n_bytes + k_bytes].view(dt).view(h.num_layers, h.num_tokens, h.rope_width)
    return n, k_pe


def _byte_views(shard: Shard) -> tuple[memoryview, memoryview]:
    """The shard's payload as zero-copy byte views of its tensors."""
    return tuple(  # type: ignore[return-value]
        memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()) for t in (shard.n, shard.k_pe)
    )


# -- receiver ------------------------------------------------------------------------------------

# Validates a shard and copies it into the cache. The tensors it gets may view a receive
# buffer that the next shard reuses, so a sink must copy, never keep them.
Sink = Callable[[kv_pb2.KvHeader, Tensor, Tensor], None]


class KvReceiverServicer(kv_pb2_grpc.KvReceiverServicer):
    """Runs on each decode rank; `sink` validates a shard and writes it into the cache."""

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
        self._staging: dict[str, Tensor] = {}
        self.bytes_received = 0

    def _check(self, context: grpc.ServicerContext) -> None:
        require_token(context, self.token)

    def Push(
        self, request_iterator: Iterator[kv_pb2.KvChunk], context: grpc.ServicerContext
    ) -> kv_pb2.KvAck:
        self._check(context)
        header: kv_pb2.KvHeader | None = None
        received, total = 0, 0
        try:
            for chunk in request_iterator:
                if header is None:
                    if not chunk.HasField("header"):
                        return kv_pb2.KvAck(ok=False, error="first chunk carries no header")
                    header = chunk.header
                    total = sum(_payload_bytes(header))
                    # Chunks are copied once, straight into the buffer the shard's tensors
                    # view: no growing bytearray, no second copy into fresh tensors.
                    raw = torch.empty(total, dtype=torch.uint8)
                    dest = memoryview(raw.numpy())
                data = chunk.data
                if received + len(data) > total:
                    raise TransferError(f"got more than the {total} bytes the header says")
                dest[received : received + len(data)] = data
                received += len(data)
            if header is None:
                return kv_pb2.KvAck(ok=False, error="empty stream")
            if received != total:
                raise TransferError(f"got {received} bytes, header says {total}")
            n, k_pe = _views(header, raw)
            self.sink(header, n, k_pe)
        except (TransferError, ValueError) as exc:
            return kv_pb2.KvAck(ok=False, error=str(exc))
        self.bytes_received += received
        return kv_pb2.KvAck(ok=True, bytes=received)

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
            n_bytes, k_bytes = _payload_bytes(request)
            with self._locks[request.peer]:
                # One staging buffer per peer, reused: a fresh one per shard would pay its
                # page faults on every transfer. The sink copies out of it under the lock.
                staging = self._staging.get(request.peer)
                if staging is None or staging.numel() < n_bytes + k_bytes:
                    staging = torch.empty(n_bytes + k_bytes, dtype=torch.uint8)
                    self._staging[request.peer] = staging
                n, k_pe = _views(request, staging)
                group.recv([n], 1, 0).wait()
                group.recv([k_pe], 1, 1).wait()
                self.sink(request, n, k_pe)
        except (TransferError, ValueError, RuntimeError) as exc:
            return kv_pb2.KvAck(ok=False, error=str(exc))
        self.bytes_received += n.nbytes + k_pe.nbytes
        return kv_pb2.KvAck(ok=True, bytes=n.nbytes + k_pe.nbytes)


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
_DATA_TAG = b"\x12"  # KvChunk.data: field 2, length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_chunks(shard: Shard, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The shard as serialized `KvChunk` messages, built straight from views of its tensors.

    Wire-identical to `KvChunk(header=..., data=...).SerializeToString()`, but each chunk
    costs one copy: constructing the message copies the payload and serializing copies it
    again, and in a sender whose GIL drives every rank's stream those copies are the cost.
    """
    header = shard.header().SerializeToString()
    head = b"\x0a" + _varint(len(header)) + header  # KvChunk.header: field 1
    first = True
    for view in _byte_views(shard):
        for start in range(0, len(view), chunk_bytes):
            data = view[start : start + chunk_bytes]
            prefix = _DATA_TAG + _varint(len(data))
            yield b"".join((head, prefix, data) if first else (prefix, data))
            first = False
    if first:  # an empty shard still announces itself
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
                ack_future = self._ch.stub(grpc_address).ExpectTorch.future(
                    shard.header(peer), timeout=left, metadata=self._ch.metadata
                )
                group.send([shard.n.contiguous()], 0, 0).wait()
                group.send([shard.k_pe.contiguous()], 0, 1).wait()
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
