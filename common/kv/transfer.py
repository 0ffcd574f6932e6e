"""KV shard transfer from prefill workers to decode ranks: one interface, two backends.

A shard is one rank's slice of one request's latent cache, layer-major and packed as the
cache stores it: kv [L, N, w + d_r], n and k_pe adjacent per token. Both backends deliver it
to the same receiver (`common.kv.receiver`), which every decode rank runs, cut into the
segments both ends agree on (`common.kv.wire`).

* `GrpcKvSender`   client-streams 1 MiB chunks (`KvReceiver.Push`) from pinned host memory;
* `TorchKvSender`  sends the segments point-to-point over a 2-rank group built once per
                   (prefill worker, decode rank) pair from the rank's TCPStore, so workers can
                   join at any time (`common.kv.pair`): NCCL from the prefill GPU straight to
                   the decode GPU, gloo from host memory otherwise; a small gRPC call carries
                   the header.

Every transfer has a deadline; a failed one leaves its reservation to the decode lease.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist
from torch import Tensor

from common.kv.framing import CHUNK_BYTES, encode_chunks
from common.kv.pair import Pair, PairBackend, PairMaker, backend_key, device_uuid, poll_until

# DTYPES and TransferError are part of this module's interface; they are defined in wire,
# whose header checks need them, so that wire does not import this module.
from common.kv.wire import DTYPES, TransferError, row_bytes, shard_segments
from common.messages import KvTargetInfo
from common.rpc.clients import CHANNEL_OPTIONS, TOKEN_METADATA_KEY
from common.rpc.gen import kv_pb2, kv_pb2_grpc


@dataclass(frozen=True)
class Shard:
    """One rank's part of a request's cache, and where it goes."""

    request_id: str
    rank: int
    kv: Tensor  # [L, N, w + d_r], contiguous: what goes on the wire
    latent_width: int  # w
    block_size: int
    block_ids: tuple[int, ...]
    # On a GPU: recorded on the stream that cut `kv`, after the cut. A send waits for this
    # event alone, not for whatever the producing stream queued since (the next prefill).
    ready: torch.cuda.Event | None = None
    block_offset: int = 0  # token 0's slot in block_ids[0] (a chunk may start inside one)
    epoch: int = 0  # the reservation's (KvTargetInfo.epoch)
    index_keys: bool = False  # DSA: the rows are indexer keys, for the index-key pool

    @property
    def n(self) -> Tensor:
        return self.kv[..., : self.latent_width]

    @property
    def k_pe(self) -> Tensor:
        return self.kv[..., self.latent_width :]

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    @property
    def payload(self) -> Tensor:
        """The packed rows as flat uint8: what goes on the wire."""
        return self.kv.contiguous().view(-1).view(torch.uint8)

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The shard (on the host) as `Push`'s serialized `KvChunk` messages, each framed
        around a view of its rows (`common.kv.framing`)."""
        header = self.header().SerializeToString()
        yield from encode_chunks(header, memoryview(self.payload.numpy()), chunk_bytes)

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
            peer=peer,
            block_offset=self.block_offset,
            epoch=self.epoch,
            index_keys=self.index_keys,
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
    device = n_layers[0].device
    if target.token_ranges:
        pairs = zip(target.token_ranges[::2], target.token_ranges[1::2], strict=True)
        owned = [p + start for lo, hi in pairs for p in range(lo, min(hi, end - start))]
        rows = torch.tensor(owned, dtype=torch.long, device=device)
        tokens = len(owned)
    else:
        rows, tokens = slice(start, end), end - start
    # Packed straight from the prefill output, on its device: the cut is the only copy
    # before the wire (or before `staged_on_host`).
    d_r = k_pe_layers[0].shape[1]
    kv = torch.empty(len(n_layers), tokens, w + d_r, dtype=n_layers[0].dtype, device=device)
    for layer, (n, k_pe) in enumerate(zip(n_layers, k_pe_layers, strict=True)):
        kv[layer, :, :w] = n[rows, cols]
        kv[layer, :, w:] = k_pe[rows]
    ready = None
    if kv.is_cuda:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(kv.device))
    return Shard(
        request_id, target.rank, kv, w, block_size, target.block_ids, ready, epoch=target.epoch
    )


def cut_chunk(
    n_layers: list[Tensor],
    k_pe_layers: list[Tensor],
    lo: int,
    hi: int,
    target: KvTargetInfo,
    request_id: str,
    block_size: int,
) -> Shard:
    """`target`'s part of rows [lo, hi) of the latents it is reserved for (row 0 = the first
    token it is sent): one chunk of a prompt shipped as it is computed, into the blocks (and
    from the slot) where the target's earlier rows end."""
    if not target.token_ranges:
        local, ranges = lo, ()
    else:
        pairs = list(zip(target.token_ranges[::2], target.token_ranges[1::2], strict=True))
        local = sum(max(0, min(b, lo) - a) for a, b in pairs)  # its tokens before the chunk
        clipped = [(max(a, lo) - lo, min(b, hi) - lo) for a, b in pairs if a < hi and b > lo]
        ranges = tuple(x for pair in clipped for x in pair)
        if not ranges:  # owns none of the chunk: an empty shard, not sent
            ranges = (0, 0)
    first = local // block_size
    part = dataclasses.replace(target, token_ranges=ranges, block_ids=target.block_ids[first:])
    shard = cut_shard(n_layers, k_pe_layers, lo, hi, part, request_id, block_size)
    used = -(-(local % block_size + shard.kv.shape[1]) // block_size)
    return dataclasses.replace(
        shard, block_ids=shard.block_ids[:used], block_offset=local % block_size
    )


def staged_on_host(shards: list[Shard]) -> list[Shard]:
    """The shards with their bytes in pinned host memory, as the senders put them on the
    wire: every device-to-host copy is issued asynchronously, then one wait covers them all.
    Shards already on the CPU are returned as they are."""
    on_device = [s for s in shards if not s.kv.is_cpu]
    if not on_device:
        return shards
    staged = []
    for shard in shards:
        if shard.kv.is_cpu:
            staged.append(shard)
            continue
        host = torch.empty(shard.kv.shape, dtype=shard.kv.dtype, pin_memory=True)
        host.copy_(shard.kv, non_blocking=True)
        staged.append(dataclasses.replace(shard, kv=host, ready=None))
    torch.cuda.current_stream(on_device[0].kv.device).synchronize()
    return staged


class KvSender(abc.ABC):
    name: str

    def prepare(self, shards: list[Shard]) -> list[Shard]:
        """The shards as `send` takes them, for all of a job's shards at once (so that one
        wait covers every device-to-host copy a backend needs). By default: on the host."""
        return staged_on_host(shards)

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
        """`KvReceiver.Push` taking pre-serialized chunks (see `Shard.chunks`)."""
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


# How long a push that found its rank unreachable waits, once, for the channel to connect:
# longer than the channel's reconnect backoff (CHANNEL_OPTIONS: at most 1 s), short enough
# that a rank that is really gone still fails its push quickly.
RECONNECT_WAIT_S = 2.0


class GrpcKvSender(KvSender):
    name = "grpc"

    def __init__(self, token: str | None = None) -> None:
        self._ch = _Channels(token)

    def send(self, shard: Shard, grpc_address: str, torch_address: str, deadline_s: float) -> int:
        push = self._ch.push(grpc_address)
        try:
            try:
                ack = push(shard.chunks(), timeout=deadline_s, metadata=self._ch.metadata)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                # A rank restarted on this address is up before the channel's reconnect
                # backoff from the old one's end has run out, which fails every call
                # meanwhile: wait for the channel once (the receiver writes a shard sent
                # twice into the same slots).
                ack = push(
                    shard.chunks(),
                    timeout=min(deadline_s, RECONNECT_WAIT_S),
                    metadata=self._ch.metadata,
                    wait_for_ready=True,
                )
        except grpc.RpcError as exc:
            raise TransferError(
                f"KV push to rank {shard.rank} at {grpc_address} failed: {exc.code().name}"
            ) from exc
        return _ack(ack, shard)

    def close(self) -> None:
        self._ch.close()


class TorchKvSender(KvSender):
    """Point-to-point tensors over one pair group per decode rank (this worker is rank 1)."""

    name = "torch"

    def __init__(self, worker_id: str, token: str | None = None, timeout_s: float = 60.0) -> None:
        self.worker_id = worker_id
        self._ch = _Channels(token)
        self.timeout = timedelta(seconds=timeout_s)
        self._pairs: dict[str, Pair] = {}
        self._names = itertools.count()  # a rebuilt pair gets a fresh name (fresh store keys)
        # One transfer at a time per decode rank keeps that pair's messages ordered; shards
        # for different ranks travel in parallel (a worker-wide lock serialized them).
        self._pair_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()  # guards the lock table
        self._streams: dict[str, torch.cuda.Stream] = {}  # per decode rank
        self._maker = PairMaker()  # NCCL pairs: built on one thread (docs/design.md §5)

    def prepare(self, shards: list[Shard]) -> list[Shard]:
        # Where the pair is NCCL the shards leave from the device; a gloo pair stages each
        # one in `send`.
        return shards

    def _pair_lock(self, torch_address: str) -> threading.Lock:
        with self._lock:
            return self._pair_locks.setdefault(torch_address, threading.Lock())

    def _pair(
        self, grpc_address: str, torch_address: str, device: torch.device, deadline: float
    ) -> Pair:
        pair = self._pairs.get(torch_address)
        if pair is not None and not pair.broken:
            return pair
        name = f"{self.worker_id}#{next(self._names)}->{torch_address}"
        host, port = torch_address.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=self.timeout)
        offer = PairBackend.NCCL if device.type == "cuda" else PairBackend.GLOO
        connect = self._ch.stub(grpc_address).ConnectTorch.future(
            kv_pb2.TorchPeer(peer=name, offer=offer.value, device_uuid=device_uuid(device)),
            timeout=max(deadline - time.monotonic(), 1.0),
            metadata=self._ch.metadata,
        )
        key = backend_key(name)
        # The receiver publishes its choice before it builds its end (and before it answers,
        # since gloo's rendezvous blocks until both ends joined): an early answer is a refusal.
        # (Each check is a round trip to the rank's store: polled coarsely, once per pair.)
        poll_until(lambda: connect.done() or store.check([key]), deadline, interval_s=0.005)
        if not store.check([key]):
            _refused(connect.result(), torch_address)
        backend = PairBackend(store.get(key).decode())
        pair = self._maker.make(store, name, 1, backend, device, self.timeout, deadline)
        _refused(connect.result(), torch_address)
        self._pairs[torch_address] = pair
        return pair

    def _stream(
        self, pair: Pair, shard: Shard, torch_address: str
    ) -> contextlib.AbstractContextManager[object]:
        """NCCL sends are queued behind the current stream: on a stream of the pair's own,
        after the shard's cut only, they wait neither for the next batch's prefill nor for
        the other ranks' sends."""
        if pair.backend is not PairBackend.NCCL:
            return contextlib.nullcontext()
        stream = self._streams.get(torch_address)
        if stream is None:
            stream = self._streams[torch_address] = torch.cuda.Stream(pair.device)
        if shard.ready is not None:
            stream.wait_event(shard.ready)
        return torch.cuda.stream(stream)

    def send(self, shard: Shard, grpc_address: str, torch_address: str, deadline_s: float) -> int:
        if not torch_address:
            raise TransferError(f"rank {shard.rank} offers no torch transport address")
        deadline = time.monotonic() + deadline_s
        pair: Pair | None = None
        try:
            with self._pair_lock(torch_address):
                pair = self._pair(grpc_address, torch_address, shard.kv.device, deadline)
                if pair.device != shard.kv.device:
                    shard = staged_on_host([shard])[0]
                header = shard.header(pair.name)
                ack_future = self._ch.stub(grpc_address).ExpectTorch.future(
                    header,
                    timeout=max(deadline - time.monotonic(), 1.0),
                    metadata=self._ch.metadata,
                )
                # Every segment is posted at once: the receiver matches them as it posts its
                # receives, and the bytes move while it writes earlier segments.
                payload = shard.payload
                row = row_bytes(header)
                with self._stream(pair, shard, torch_address):
                    sends = [
                        pair.send(payload[seg.start * row : seg.stop * row], tag)
                        for tag, seg in enumerate(shard_segments(header).segments)
                    ]
                ack = ack_future.result()
                if ack.pair_lost:
                    self._failed(pair, torch_address)
                else:
                    pair.complete(sends, deadline)
        except grpc.RpcError as exc:
            self._failed(pair, torch_address)
            raise TransferError(
                f"torch KV transfer to rank {shard.rank} failed: {exc.code().name}"
            ) from exc
        except (TransferError, RuntimeError) as exc:  # gloo / NCCL errors, deadlines
            self._failed(pair, torch_address)
            raise TransferError(f"torch KV transfer to rank {shard.rank} failed: {exc}") from exc
        return _ack(ack, shard)

    def _failed(self, pair: Pair | None, torch_address: str) -> None:
        """A transfer on `pair` failed midway: the next shard builds a new pair."""
        if pair is not None:
            pair.fail()
            if self._pairs.get(torch_address) is pair:
                del self._pairs[torch_address]

    def close(self) -> None:
        self._ch.close()
        self._pairs.clear()
        self._maker.close()


def _refused(ack: kv_pb2.KvAck, torch_address: str) -> None:
    if not ack.ok:
        raise TransferError(f"torch pair with {torch_address} refused: {ack.error}")


def make_sender(name: str, worker_id: str, token: str | None = None) -> KvSender:
    if name == "grpc":
        return GrpcKvSender(token)
    if name == "torch":
        return TorchKvSender(worker_id, token)
    raise ValueError(f"unknown KV transport {name!r} (grpc, torch)")
