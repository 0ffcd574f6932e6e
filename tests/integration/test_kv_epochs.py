"""Reservation epochs on a real decode group (tp = 2, gRPC KV receivers): a request aborted
while its KV push is still in flight, its blocks reserved again by another request whose own
push lands, and then the rest of the old push arriving: on every rank the old rows never land
(rank 0's cache holds the new request's rows only; both ranks refuse the old push, counted),
whether the push's rows go through staging or straight into the cache."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from common.kv.slots import token_slots
from common.kv.transfer import GrpcKvSender, Shard, TransferError, cut_shard
from common.messages import KvTargetInfo, Reservation
from common.parallel import ParallelConfig
from common.runtime.ports import free_port, kv_port_offsets
from services.decode.config import EngineConfig
from services.decode.engine import DecodeEngine
from tests.tiny import save_hf

BS, MAX_TOKENS = 4, 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DecodeEngine]:
    path = tmp_path_factory.mktemp("epochs-model")
    # A wide latent: a 600-token prompt's rows of a layer are a run long enough to be
    # received straight into the cache.
    save_hf("v2-greedy", path, kv_lora_rank=256)
    cfg = EngineConfig(
        model=str(path),
        parallel=ParallelConfig(tp=2, latent_groups=1),
        master_port=free_port(),
        kv_budget_mb=2.2,
        block_size=BS,
        kv_port_base=free_port(kv_port_offsets(2)),
    )
    with DecodeEngine(cfg) as engine:
        yield engine


@dataclass(frozen=True)
class _Paused:
    """A shard whose push stops after its first chunk until `go` is set (`started` then)."""

    shard: Shard
    started: threading.Event
    go: threading.Event

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def request_id(self) -> str:
        return self.shard.request_id

    def chunks(self) -> Iterator[bytes]:
        for i, chunk in enumerate(self.shard.chunks(chunk_bytes=16 * 2**10)):
            if i == 1:
                self.started.set()
                assert self.go.wait(60)
            yield chunk


def _shard(res: Reservation, target: KvTargetInfo, prompt: int, value: float) -> Shard:
    layers, d_r = res.num_layers, res.rope_width
    n = [torch.full((prompt, 256), value) for _ in range(layers)]
    k_pe = [torch.full((prompt, d_r), value) for _ in range(layers)]
    return cut_shard(n, k_pe, 0, prompt, target, res.request_id, res.block_size)


@pytest.mark.parametrize("prompt", [40, 600])  # staged segments; rows straight into the cache
def test_a_late_push_never_lands_in_blocks_given_out_again(
    engine: DecodeEngine, prompt: int
) -> None:
    need = -(-(prompt + MAX_TOKENS - 1) // BS)
    free = engine.pool.pools[0].num_free
    # The free blocks beyond one request's are held, so the next request gets the same ones.
    engine.reserve("filler", (free - need) * BS - MAX_TOKENS + 1, MAX_TOKENS)
    old = engine.reserve("old", prompt, MAX_TOKENS)
    dropped = engine.runtime.epochs.dropped
    sender = GrpcKvSender()
    started = [threading.Event() for _ in old.targets]
    go = threading.Event()
    outcomes: list[BaseException | int] = []

    def push(target: KvTargetInfo, started: threading.Event) -> None:
        paused = _Paused(_shard(old, target, prompt, 1.0), started, go)
        try:
            outcomes.append(sender.send(paused, target.grpc_address, "", 60))  # type: ignore[arg-type]
        except TransferError as exc:
            outcomes.append(exc)

    pushes = [threading.Thread(target=push, args=a) for a in zip(old.targets, started, strict=True)]
    for t in pushes:
        t.start()
    try:
        assert all(s.wait(30) for s in started)  # both pushes are in flight
        assert engine.abort("old")
        new = engine.reserve("new", prompt, MAX_TOKENS)
        assert new.epoch > old.epoch
        for o, n in zip(old.targets, new.targets, strict=True):
            assert set(n.block_ids) == set(o.block_ids)  # the same blocks, given out again
            sender.send(_shard(new, n, prompt, 2.0), n.grpc_address, "", 60)
    finally:
        go.set()
        for t in pushes:
            t.join(60)
    assert len(outcomes) == 2 and all(isinstance(o, TransferError) for o in outcomes)
    assert all("no longer its blocks'" in str(o) for o in outcomes)
    blocks = torch.tensor(new.targets[0].block_ids)
    slots = token_slots(blocks, torch.arange(prompt), BS)
    rows = engine.runtime.cache.kv[:, slots]
    assert torch.equal(rows, torch.full_like(rows, 2.0))  # the new request's rows alone
    assert engine.runtime.epochs.dropped == dropped + 1  # rank 0's count (rank 1 has its own)
    sender.close()
    engine.abort("new")
    engine.abort("filler")
