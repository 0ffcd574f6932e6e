"""Each rank of a prefill group ships only its own decode ranks' shards (j, j + N, ...), cut
as one process cuts them."""

from __future__ import annotations

import torch

from common.kv.transfer import KvSender, Shard
from common.messages import KvTargetInfo
from services.prefill.shipping import ShipOrder, Shipper, ships


class Recorder(KvSender):
    name = "recorder"

    def __init__(self) -> None:
        self.shards: list[Shard] = []

    def send(self, shard: Shard, grpc_address: str, torch_address: str, deadline_s: float) -> int:
        self.shards.append(shard)
        return shard.nbytes


def test_ranks_split_the_decode_ranks_round_robin() -> None:
    assert [r for r in range(5) if ships(r, 0, 2)] == [0, 2, 4]
    assert [r for r in range(5) if ships(r, 1, 2)] == [1, 3]
    assert all(ships(r, 0, 1) for r in range(5))


def test_a_rank_cuts_and_sends_its_targets_only() -> None:
    n = [torch.randn(20, 8) for _ in range(2)]
    k_pe = [torch.randn(20, 4) for _ in range(2)]
    targets = tuple(KvTargetInfo(r, f"rank{r}", "", 2 * r, 2, (0, 1)) for r in range(4))
    order = ShipOrder("req", 24, 4, 16, targets, 5.0)
    shards = {}
    for rank in range(3):
        recorder = Recorder()
        shipper = Shipper(recorder, torch.device("cpu"))
        sent = [f.result(timeout=10) for f in shipper.ship(order, n, k_pe, rank, 3)]
        shipper.close()
        assert sum(sent) == sum(s.nbytes for s in recorder.shards)
        shards[rank] = recorder.shards
    assert {rank: [s.rank for s in got] for rank, got in shards.items()} == {
        0: [0, 3],
        1: [1],
        2: [2],
    }
    alone = Recorder()
    shipper = Shipper(alone, torch.device("cpu"))
    for f in shipper.ship(order, n, k_pe):
        f.result(timeout=10)
    shipper.close()
    by_rank = {s.rank: s for got in shards.values() for s in got}
    for shard in alone.shards:
        assert torch.equal(by_rank[shard.rank].kv, shard.kv)
