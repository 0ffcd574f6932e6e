"""KV transfer into GPU pools (`make test-gpu`; every test skips with its reason where CUDA,
or a second GPU, is missing): NCCL from one GPU straight into another's pool, the gRPC and
gloo paths into a CUDA pool through pinned staging, and `tpla eval` on CUDA. The same
receiver and senders the CPU tests run."""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.kv.paged_cache import PagedLatentCache
from common.kv.pair import PairBackend
from common.kv.receiver import KvReceiverServicer, ShardTarget
from common.kv.transfer import GrpcKvSender, TorchKvSender, TransferError
from common.kv.wire import shard_slots
from common.rpc.gen import kv_pb2
from common.tpla.eval import EvalConfig, evaluate
from tests.kv_pairs import BLOCKS, Ports, Receiver, layout, make_shard

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="NCCL device-to-device transfer needs two visible GPUs",
)

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"
DEADLINE_S = 60.0
SCATTERED = tuple(range(1, 60, 3))
CONTIGUOUS = tuple(range(8, 40))


@pytest.fixture
def sender() -> Iterator[TorchKvSender]:
    s = TorchKvSender("gpu-test", timeout_s=60)
    yield s
    s.close()


@two_gpus
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nccl_moves_shards_from_gpu_to_gpu(sender: TorchKvSender, dtype: torch.dtype) -> None:
    """Prefill shards on GPU 0, the rank's pool on GPU 1: an NCCL pair, exact rows, a refused
    shard drained, and contiguous (in place) and scattered (staged) blocks alike."""
    ports = Ports.free()
    recv = Receiver(ports, "cuda:1", dtype)
    try:
        shards = [
            make_shard("r1", 37, (5, 2, 9), seed=1, device="cuda:0", dtype=dtype),
            make_shard("r2", 300, SCATTERED, seed=2, device="cuda:0", dtype=dtype),
            make_shard("r3", 500, CONTIGUOUS, seed=3, device="cuda:0", dtype=dtype),
        ]
        for shard in shards[:2]:
            assert sender.send(shard, *ports.addresses, DEADLINE_S) == shard.nbytes
        refused = make_shard("bad-1", 40, (50, 51, 52), seed=4, device="cuda:0", dtype=dtype)
        with pytest.raises(TransferError, match="no reservation"):
            sender.send(refused, *ports.addresses, DEADLINE_S)
        assert sender.send(shards[2], *ports.addresses, DEADLINE_S) == shards[2].nbytes
        assert all(recv.landed(s) for s in shards)
        (pair,) = sender._pairs.values()
        assert pair.backend is PairBackend.NCCL and pair.device == torch.device("cuda:0")
    finally:
        recv.close()


@two_gpus
def test_a_stalled_nccl_receiver_fails_by_the_deadline_and_gets_a_new_pair(
    sender: TorchKvSender,
) -> None:
    ports = Ports.free()
    recv = Receiver(ports, "cuda:1")
    try:
        sender.send(make_shard("r1", 20, (3, 4), 1, "cuda:0"), *ports.addresses, DEADLINE_S)
        assert recv.proc.pid is not None
        os.kill(recv.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(TransferError):
                sender.send(make_shard("r2", 20, (6, 7), 2, "cuda:0"), *ports.addresses, 3.0)
            assert time.monotonic() - t0 < 15
        finally:
            os.kill(recv.proc.pid, signal.SIGCONT)
        later = make_shard("r3", 20, (8, 9), 3, "cuda:0")
        assert sender.send(later, *ports.addresses, DEADLINE_S) == later.nbytes
        assert recv.landed(later)
    finally:
        recv.close()


def test_gloo_from_host_memory_into_a_cuda_pool(sender: TorchKvSender) -> None:
    """A prefill worker on the CPU (or on the rank's own GPU): a gloo pair, the rows staged
    in pinned host memory and copied up asynchronously."""
    ports = Ports.free()
    recv = Receiver(ports, "cuda:0")
    try:
        for seed, blocks in enumerate(((5, 2, 9), SCATTERED, CONTIGUOUS)):
            shard = make_shard(f"r{seed}", 16 * len(blocks) - 3, blocks, seed)
            assert sender.send(shard, *ports.addresses, DEADLINE_S) == shard.nbytes
            assert recv.landed(shard)
        (pair,) = sender._pairs.values()
        assert pair.backend is PairBackend.GLOO
    finally:
        recv.close()


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("blocks", [(5, 2, 9), SCATTERED, CONTIGUOUS])
def test_grpc_push_into_a_cuda_pool(wire: torch.dtype, blocks: tuple[int, ...]) -> None:
    """The gRPC receive path into a GPU pool: pinned staging, one wait per shard; a wire
    dtype other than the pool's is converted on the device."""
    cache = PagedLatentCache(layout(torch.float32), BLOCKS, "cuda")
    written: list[float] = []

    def sink(header: kv_pb2.KvHeader) -> ShardTarget:
        return ShardTarget(cache, shard_slots(header), written.append)

    shard = make_shard("r", 16 * len(blocks) - 5, blocks, seed=len(blocks), dtype=wire)
    servicer = KvReceiverServicer(sink, None, device=cache.kv.device)
    assert servicer._push(iter(shard.chunks(4096))) == shard.nbytes
    slots = shard_slots(shard.header()).cuda()
    assert torch.equal(cache.kv[:, slots].cpu(), shard.kv.float())
    assert len(written) == 1


def test_grpc_sender_stages_device_shards_on_the_host() -> None:
    shard = make_shard("r", 20, (1, 2), seed=9, device="cuda")
    (staged,) = GrpcKvSender().prepare([shard])
    assert staged.kv.is_pinned() and torch.equal(staged.kv, shard.kv.cpu())


def test_eval_on_cuda_matches_the_cpu() -> None:
    """`tpla eval`'s perplexities on CUDA in fp32 equal the CPU's (same windows, same bases)."""
    config = dict(groups=2, window=64, prefill_len=16, max_tokens=400, progress=False)
    cpu = evaluate(DEMO, EvalConfig(**config))  # type: ignore[arg-type]
    gpu = evaluate(DEMO, EvalConfig(**config, device="cuda", dtype="float32"))  # type: ignore[arg-type]
    assert gpu.scored_tokens == cpu.scored_tokens
    for a, b in zip(cpu.results, gpu.results, strict=True):
        assert a.key == b.key and math.isclose(a.ppl, b.ppl, rel_tol=1e-3), (a, b)
