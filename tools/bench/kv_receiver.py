"""The receiving side of `tpla bench kv-transfer`: one decode rank's KV endpoints, alone.

Run as `python -m tools.bench.kv_receiver CONFIG_JSON` (one process per rank, as in a real
decode group). It serves the project's `KvReceiverServicer` (gRPC push and torch p2p) with a
sink that validates each shard and writes it into a real `PagedLatentCache`, exactly as
`RankRuntime.shard_target` does, plus a raw TCP listener: the wire ceiling the transports are
compared with, and the bench's control channel (cache checksums, reset, stop).

Raw TCP protocol, one request at a time per connection:
    b"P" + u64 length + payload  -> u64 length           (payload lands in a reused buffer)
    b"C" + u32 length + JSON     -> u32 length + JSON    (sha256 of the cache at a block table,
                                                          and the request's sink times)

It also serves `RAW_GRPC_METHOD`: a bare byte stream through grpcio (no protobuf, no cache
write), the library's own ceiling on this machine, to tell the transport's cost from grpcio's.
    b"Q"                         -> b"Q", then the process exits
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist
from torch import Tensor

from common.group.child import exit_with_parent
from common.kv.paged_cache import CacheLayout, PagedLatentCache
from common.kv.receiver import KvReceiverServicer, ShardTarget, add_kv_receiver
from common.kv.transfer import DTYPES, TransferError
from common.kv.wire import shard_slots
from common.rpc.clients import CHANNEL_OPTIONS
from common.rpc.gen import kv_pb2

READY = "KV-RECEIVER-READY"
RAW_GRPC_METHOD = "/tpla.bench.RawGrpc/Push"


@dataclass(frozen=True)
class ReceiverConfig:
    rank: int
    num_layers: int
    latent_width: int
    rope_width: int
    block_size: int
    num_blocks: int
    dtype: str
    grpc_port: int
    torch_port: int
    raw_port: int
    host: str = "127.0.0.1"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @property
    def layout(self) -> CacheLayout:
        return CacheLayout(
            self.num_layers, self.latent_width, self.rope_width, self.block_size, DTYPES[self.dtype]
        )


def cache_digest(cache: PagedLatentCache, slots: Tensor) -> str:
    """sha256 of the cached bytes at `slots`, in shard order (n [L, N, w] then k_pe)."""
    digest = hashlib.sha256()
    for part in (cache.n[:, slots], cache.k_pe[:, slots]):
        digest.update(part.contiguous().view(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


class CacheSink:
    """The checks of RankRuntime.shard_target, into a real paged cache; records the time the
    receiver spent writing each shard into it."""

    def __init__(self, cfg: ReceiverConfig) -> None:
        self.cfg = cfg
        self.cache = PagedLatentCache(cfg.layout, cfg.num_blocks)
        self.seconds: dict[str, list[float]] = {}  # request id -> time spent in each write

    def __call__(self, header: kv_pb2.KvHeader) -> ShardTarget:
        times = self.seconds.setdefault(header.request_id, [])
        return ShardTarget(self.cache, self._slots(header), times.append)

    def _slots(self, header: kv_pb2.KvHeader) -> Tensor:
        lay = self.cache.layout
        if header.rank != self.cfg.rank:
            raise TransferError(f"shard for rank {header.rank} sent to rank {self.cfg.rank}")
        shape = (header.num_layers, header.latent_width, header.rope_width)
        if shape != (lay.num_layers, lay.latent_width, lay.rope_width):
            raise TransferError(f"shard shape {shape} does not match this rank's cache")
        if header.block_size != lay.block_size:
            raise TransferError(f"block size {header.block_size} != {lay.block_size}")
        slots = shard_slots(header)
        if len(slots) and int(slots.max()) >= self.cache.num_blocks * lay.block_size:
            raise TransferError("shard addresses blocks outside this rank's pool")
        return slots


def recv_exact(conn: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket (recv returns whatever has arrived so far)."""
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed mid-message")
        got += n


def _serve_raw(conn: socket.socket, sink: CacheSink, stop: threading.Event) -> None:
    buf = bytearray()
    head = bytearray(8)
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            op = conn.recv(1)
            if not op:
                return
            if op == b"P":
                recv_exact(conn, memoryview(head))
                (length,) = struct.unpack("<Q", head)
                if len(buf) < length:
                    buf = bytearray(length)  # reused across messages, like a staging buffer
                recv_exact(conn, memoryview(buf)[:length])
                conn.sendall(struct.pack("<Q", length))
            elif op == b"C":
                recv_exact(conn, memoryview(head)[:4])
                (length,) = struct.unpack("<I", head[:4])
                body = bytearray(length)
                recv_exact(conn, memoryview(body))
                query = json.loads(body)
                header = kv_pb2.KvHeader(
                    num_tokens=query["num_tokens"],
                    block_size=query["block_size"],
                    block_ids=query["block_ids"],
                )
                reply = json.dumps(
                    {
                        "sha256": cache_digest(sink.cache, shard_slots(header)),
                        "sink_seconds": sink.seconds.get(query["request_id"], []),
                    }
                )
                conn.sendall(struct.pack("<I", len(reply)) + reply.encode())
            elif op == b"Q":
                conn.sendall(b"Q")
                stop.set()
                return
            else:
                raise ConnectionError(f"unknown op {op!r}")


def _raw_grpc_push(chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
    total = 0
    for chunk in chunks:
        total += len(chunk)
    return struct.pack("<Q", total)


def main(cfg: ReceiverConfig) -> None:
    exit_with_parent()
    torch.set_num_threads(1)
    sink = CacheSink(cfg)
    store = dist.TCPStore(
        cfg.host,
        cfg.torch_port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
    )
    server = grpc.server(ThreadPoolExecutor(max_workers=8), options=CHANNEL_OPTIONS)
    # Registered exactly as RankRuntime.start_kv_receiver registers it.
    add_kv_receiver(KvReceiverServicer(sink, store), server)
    service, method = RAW_GRPC_METHOD.rsplit("/", 1)
    handler = grpc.stream_unary_rpc_method_handler(_raw_grpc_push)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.lstrip("/"), {method: handler}),)
    )
    if server.add_insecure_port(f"{cfg.host}:{cfg.grpc_port}") == 0:
        raise RuntimeError(f"cannot bind the KV receiver on {cfg.host}:{cfg.grpc_port}")
    server.start()
    listener = socket.create_server((cfg.host, cfg.raw_port))
    listener.settimeout(0.5)  # so the accept loop notices `stop`
    stop = threading.Event()
    print(READY, flush=True)
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        threading.Thread(target=_serve_raw, args=(conn, sink, stop), daemon=True).start()
    listener.close()
    server.stop(grace=1)


if __name__ == "__main__":
    main(ReceiverConfig(**json.loads(sys.argv[1])))
