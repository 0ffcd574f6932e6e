"""The torch transport's pair groups between real processes (gloo on CPU tensors: the code
path NCCL takes on GPUs, with the other backend): shards land byte for byte over one pair, a
rejected shard is drained so the pair stays matched, a receiver that restarted is met with a
new pair instead of a dead one, and a stalled one fails the transfer by its deadline."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch

from common.kv.pair import PairBackend, choose_backend
from common.kv.transfer import TorchKvSender, TransferError
from tests.kv_pairs import Ports, Receiver, make_shard

DEADLINE_S = 20.0


@pytest.fixture
def ports() -> Ports:
    return Ports.free()


@pytest.fixture
def sender() -> Iterator[TorchKvSender]:
    s = TorchKvSender("test-worker", timeout_s=30)
    yield s
    s.close()


def test_shards_land_over_one_pair_and_a_refused_one_is_drained(
    ports: Ports, sender: TorchKvSender
) -> None:
    recv = Receiver(ports)
    try:
        first = make_shard("r1", 37, (5, 2, 9), seed=1)
        assert sender.send(first, *ports.addresses, DEADLINE_S) == first.nbytes
        assert recv.landed(first)
        refused = make_shard("bad-1", 40, (11, 12, 13), seed=2)
        with pytest.raises(TransferError, match="no reservation for bad-1"):
            sender.send(refused, *ports.addresses, DEADLINE_S)
        # The refused shard's messages were drained: the same pair carries the next one.
        second = make_shard("r2", 300, tuple(range(20, 40)), seed=3)
        assert sender.send(second, *ports.addresses, DEADLINE_S) == second.nbytes
        assert recv.landed(second) and recv.landed(first)
        pairs = list(sender._pairs.values())
        assert [p.name for p in pairs] == [f"test-worker#0->{ports.addresses[1]}"]
        assert pairs[0].backend is PairBackend.GLOO
    finally:
        recv.close()


def test_a_restarted_receiver_gets_a_new_pair(ports: Ports, sender: TorchKvSender) -> None:
    recv = Receiver(ports)
    try:
        shard = make_shard("r1", 20, (3, 4), seed=4)
        sender.send(shard, *ports.addresses, DEADLINE_S)
        assert recv.landed(shard)
    finally:
        recv.close()
    recv = Receiver(ports)  # the same addresses, a new store and no pairs
    try:
        later = make_shard("r2", 20, (6, 7), seed=5)
        # The first shard after the restart finds its pair gone (it fails, as a transfer to
        # a restarted rank must: its reservation went with it); the next builds a new pair.
        with pytest.raises(TransferError):
            sender.send(later, *ports.addresses, DEADLINE_S)
        assert sender.send(later, *ports.addresses, DEADLINE_S) == later.nbytes
        assert recv.landed(later)
    finally:
        recv.close()


def test_a_stalled_receiver_fails_the_transfer_by_its_deadline(
    ports: Ports, sender: TorchKvSender
) -> None:
    recv = Receiver(ports)
    try:
        sender.send(make_shard("r1", 20, (3, 4), seed=6), *ports.addresses, DEADLINE_S)
        assert recv.proc.pid is not None
        os.kill(recv.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(TransferError):
                sender.send(make_shard("r2", 20, (6, 7), seed=7), *ports.addresses, 2.0)
            assert time.monotonic() - t0 < 10  # the deadline, not a collective's timeout
        finally:
            os.kill(recv.proc.pid, signal.SIGCONT)
        # The stalled pair was aborted: the rank, awake again, gets a new one.
        later = make_shard("r3", 20, (8, 9), seed=8)
        assert sender.send(later, *ports.addresses, DEADLINE_S) == later.nbytes
        assert recv.landed(later)
    finally:
        recv.close()


def test_the_receiver_chooses_nccl_only_between_two_gpus() -> None:
    cpu = torch.device("cpu")
    assert choose_backend(PairBackend.NCCL, "GPU-a", cpu) is PairBackend.GLOO
    assert choose_backend(PairBackend.GLOO, "", cpu) is PairBackend.GLOO
