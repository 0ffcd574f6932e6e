"""The torch transport's pair groups between real processes (gloo on CPU tensors: the code
path NCCL takes on GPUs, with the other backend): shards land byte for byte over one pair, a
rejected shard is drained so the pair stays matched, a receiver that restarted is met with a
new pair instead of a dead one, and a stalled one fails the transfer by its deadline."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from common.kv.paged_cache import CacheLayout, PagedLatentCache
from common.kv.pair import PairBackend, choose_backend
from common.kv.receiver import KvReceiverServicer, ShardTarget, add_kv_receiver
from common.kv.transfer import Shard, TorchKvSender, TransferError
from common.kv.wire import shard_slots
from common.ports import free_ports
from common.rpc.gen import kv_pb2

LAYOUT = CacheLayout(
    num_layers=3, latent_width=24, rope_width=8, block_size=16, dtype=torch.float32
)
BLOCKS = 64
DEADLINE_S = 20.0


@dataclass(frozen=True)
class Ports:
    grpc: int
    store: int

    @property
    def addresses(self) -> tuple[str, str]:
        return f"127.0.0.1:{self.grpc}", f"127.0.0.1:{self.store}"


def _receiver(ports: Ports, out: mp.Queue, stop: mp.Event) -> None:  # type: ignore[type-arg]
    """A decode rank's KV endpoints in a process of its own; its cache is shared memory the
    test reads. Shards of requests named "bad-*" are refused by the sink."""
    import grpc

    torch.set_num_threads(1)
    cache = PagedLatentCache(LAYOUT, BLOCKS)
    cache.kv.share_memory_()

    def sink(header: kv_pb2.KvHeader) -> ShardTarget:
        if header.request_id.startswith("bad"):
            raise TransferError(f"no reservation for {header.request_id}")
        return ShardTarget(cache, shard_slots(header))

    store = dist.TCPStore(
        "127.0.0.1", ports.store, is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    add_kv_receiver(KvReceiverServicer(sink, store, timeout_s=30), server)
    server.add_insecure_port(f"127.0.0.1:{ports.grpc}")
    server.start()
    out.put(cache.kv)
    stop.wait(120)
    server.stop(grace=0)


class Receiver:
    def __init__(self, ports: Ports) -> None:
        ctx = tmp.get_context("spawn")
        self.stop = ctx.Event()
        out = ctx.Queue()
        self.proc = ctx.Process(target=_receiver, args=(ports, out, self.stop), daemon=True)
        self.proc.start()
        self.kv: torch.Tensor = out.get(timeout=60)

    def close(self) -> None:
        self.stop.set()
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)


@pytest.fixture
def ports() -> Ports:
    grpc_port, store_port = free_ports(2)
    return Ports(grpc_port, store_port)


@pytest.fixture
def sender() -> Iterator[TorchKvSender]:
    s = TorchKvSender("test-worker", timeout_s=30)
    yield s
    s.close()


def _shard(request_id: str, tokens: int, blocks: tuple[int, ...], seed: int) -> Shard:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(LAYOUT.num_layers, tokens, 32, generator=g)
    return Shard(request_id, 0, kv, LAYOUT.latent_width, LAYOUT.block_size, blocks)


def _landed(kv: torch.Tensor, shard: Shard) -> bool:
    return torch.equal(kv[:, shard_slots(shard.header())], shard.kv)


def test_shards_land_over_one_pair_and_a_refused_one_is_drained(
    ports: Ports, sender: TorchKvSender
) -> None:
    recv = Receiver(ports)
    try:
        first = _shard("r1", 37, (5, 2, 9), seed=1)
        assert sender.send(first, *ports.addresses, DEADLINE_S) == first.nbytes
        assert _landed(recv.kv, first)
        with pytest.raises(TransferError, match="no reservation for bad-1"):
            sender.send(_shard("bad-1", 40, (11, 12, 13), seed=2), *ports.addresses, DEADLINE_S)
        # The refused shard's messages were drained: the same pair carries the next one.
        second = _shard("r2", 300, tuple(range(20, 40)), seed=3)
        assert sender.send(second, *ports.addresses, DEADLINE_S) == second.nbytes
        assert _landed(recv.kv, second) and _landed(recv.kv, first)
        assert [p.name for p in sender._pairs.values()] == [f"test-worker#0->{ports.addresses[1]}"]
    finally:
        recv.close()


def test_a_restarted_receiver_gets_a_new_pair(ports: Ports, sender: TorchKvSender) -> None:
    recv = Receiver(ports)
    try:
        shard = _shard("r1", 20, (3, 4), seed=4)
        sender.send(shard, *ports.addresses, DEADLINE_S)
        assert _landed(recv.kv, shard)
    finally:
        recv.close()
    recv = Receiver(ports)  # the same addresses, a new store and no pairs
    try:
        later = _shard("r2", 20, (6, 7), seed=5)
        # The first shard after the restart finds its pair gone (it fails, as a transfer to
        # a restarted rank must: its reservation went with it); the next builds a new pair.
        with pytest.raises(TransferError):
            sender.send(later, *ports.addresses, DEADLINE_S)
        assert sender.send(later, *ports.addresses, DEADLINE_S) == later.nbytes
        assert _landed(recv.kv, later)
    finally:
        recv.close()


def test_a_stalled_receiver_fails_the_transfer_by_its_deadline(
    ports: Ports, sender: TorchKvSender
) -> None:
    recv = Receiver(ports)
    try:
        sender.send(_shard("r1", 20, (3, 4), seed=6), *ports.addresses, DEADLINE_S)
        assert recv.proc.pid is not None
        os.kill(recv.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(TransferError):
                sender.send(_shard("r2", 20, (6, 7), seed=7), *ports.addresses, 2.0)
            assert time.monotonic() - t0 < 10  # the deadline, not a collective's timeout
        finally:
            os.kill(recv.proc.pid, signal.SIGCONT)
        # The stalled pair was aborted: the rank, awake again, gets a new one.
        later = _shard("r3", 20, (8, 9), seed=8)
        assert sender.send(later, *ports.addresses, DEADLINE_S) == later.nbytes
        assert _landed(recv.kv, later)
    finally:
        recv.close()


def test_the_receiver_chooses_nccl_only_between_two_gpus() -> None:
    cpu = torch.device("cpu")
    assert choose_backend(PairBackend.NCCL, "GPU-a", cpu) is PairBackend.GLOO
    assert choose_backend(PairBackend.GLOO, "", cpu) is PairBackend.GLOO
