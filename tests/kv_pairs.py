"""A decode rank's KV endpoints (gRPC receiver and TCPStore) in a process of its own, with
its paged cache on a chosen device, for the torch transport's tests on CPU and on GPUs."""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from common.kv.paged_cache import CacheLayout, PagedLatentCache
from common.kv.receiver import KvReceiverServicer, ShardTarget, add_kv_receiver
from common.kv.transfer import Shard, TransferError
from common.kv.wire import shard_slots
from common.rpc.gen import kv_pb2
from common.runtime.ports import free_ports

LATENT, ROPE, BLOCK, LAYERS = 24, 8, 16, 3
BLOCKS = 64


@dataclass(frozen=True)
class Ports:
    grpc: int
    store: int

    @classmethod
    def free(cls) -> Ports:
        return cls(*free_ports(2))

    @property
    def addresses(self) -> tuple[str, str]:
        return f"127.0.0.1:{self.grpc}", f"127.0.0.1:{self.store}"


def layout(dtype: torch.dtype = torch.float32) -> CacheLayout:
    return CacheLayout(LAYERS, LATENT, ROPE, BLOCK, dtype)


def _serve(ports: Ports, device: str, dtype: torch.dtype, out: mp.Queue, stop: mp.Event) -> None:  # type: ignore[type-arg]
    import grpc

    torch.set_num_threads(1)
    cache = PagedLatentCache(layout(dtype), BLOCKS, device)
    if cache.kv.is_cpu:
        cache.kv.share_memory_()  # (a CUDA tensor is shared through its IPC handle)

    def sink(header: kv_pb2.KvHeader) -> ShardTarget:
        if header.request_id.startswith("bad"):
            raise TransferError(f"no reservation for {header.request_id}")
        return ShardTarget(cache, shard_slots(header))

    store = dist.TCPStore(
        "127.0.0.1", ports.store, is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    receiver = KvReceiverServicer(sink, store, timeout_s=30, device=cache.kv.device)
    add_kv_receiver(receiver, server)
    server.add_insecure_port(f"127.0.0.1:{ports.grpc}")
    server.start()
    out.put(cache.kv)
    stop.wait(300)
    server.stop(grace=0)


class Receiver:
    """The rank's process; `kv` is its cache, shared with the test (read it, never write).
    Shards of requests named "bad-*" are refused by its sink."""

    def __init__(
        self, ports: Ports, device: str = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        ctx = tmp.get_context("spawn")
        self.stop = ctx.Event()
        out = ctx.Queue()
        self.proc = ctx.Process(
            target=_serve, args=(ports, device, dtype, out, self.stop), daemon=True
        )
        self.proc.start()
        self.kv: torch.Tensor = out.get(timeout=120)

    def landed(self, shard: Shard) -> bool:
        """Whether the cache holds exactly the shard's rows (in the cache's dtype)."""
        slots = shard_slots(shard.header()).to(self.kv.device)
        return torch.equal(self.kv[:, slots].cpu(), shard.kv.to(self.kv.dtype).cpu())

    def close(self) -> None:
        del self.kv  # before its producer exits (a CUDA tensor's IPC handle)
        self.stop.set()
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)


def make_shard(
    request_id: str,
    tokens: int,
    blocks: tuple[int, ...],
    seed: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Shard:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(LAYERS, tokens, LATENT + ROPE, generator=g).to(device, dtype)
    return Shard(request_id, 0, kv, LATENT, BLOCK, blocks)
