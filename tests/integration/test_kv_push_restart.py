"""A KV receiver restarted on the same address takes the next push at once over gRPC: the
sender's channel, still in its reconnect backoff from the old receiver's end, is waited for
once instead of failing the push. A receiver that stays gone still fails it, quickly."""

from __future__ import annotations

import time

import pytest
import torch

from common.kv.transfer import RECONNECT_WAIT_S, GrpcKvSender, Shard, TransferError, cut_shard
from tests.recording_kv import Receivers, targets

ROWS, D_C, D_R, BLOCK = 10, 16, 4, 16


def _shard(request_id: str, address: str) -> Shard:
    g = torch.Generator().manual_seed(0)
    n = [torch.randn(ROWS, D_C, generator=g) for _ in range(2)]
    k_pe = [torch.randn(ROWS, D_R, generator=g) for _ in range(2)]
    [target, _] = targets("tpla", 2, D_C, ROWS, 0, address)
    return cut_shard(n, k_pe, 0, ROWS, target, request_id, BLOCK)


def test_a_push_reaches_a_receiver_restarted_on_its_address() -> None:
    sender = GrpcKvSender()
    first = Receivers()
    address = first.address
    try:
        shard = _shard("before", address)
        assert sender.send(shard, address, "", 10.0) > 0
        first.close()
        with pytest.raises(TransferError, match="failed"):
            sender.send(_shard("gone", address), address, "", 10.0)
        again = Receivers(address=address)  # back before the channel's backoff ends
        try:
            shard = _shard("after", address)
            assert sender.send(shard, address, "", 10.0) == shard.nbytes
            assert ("after", 0) in again.caches
        finally:
            again.close()
        started = time.monotonic()
        with pytest.raises(TransferError, match="failed"):
            sender.send(_shard("gone again", address), address, "", 30.0)
        assert time.monotonic() - started < RECONNECT_WAIT_S + 2.0
    finally:
        sender.close()
