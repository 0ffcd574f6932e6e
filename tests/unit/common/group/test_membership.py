"""The settings place a process in a group over hosts once: `--rank K --group-size N` (one
rank a host) or `--node K --nodes M` (tp / M ranks a host, this process the host's first);
what cannot work is a clear error naming the flags."""

from __future__ import annotations

import pytest

from common.group.membership import Membership, joined, membership, process_rank
from common.runtime.settings import load_settings


def test_a_host_of_a_group_over_hosts_runs_its_run_of_ranks() -> None:
    s = load_settings(tp=16, node=1, nodes=2, group_addr="leader:29500")
    assert joined(s)
    assert membership(s, s.tp, "TPLA_TP") == Membership(16, 8, 8, "leader", 29500)
    assert process_rank(s, s.tp, "TPLA_TP") == 8
    one = load_settings(rank=1, group_size=2, group_addr="leader:29500")
    assert membership(one, one.tp, "TPLA_TP") == Membership(2, 1, 1, "leader", 29500)
    spawned = load_settings(tp=4)
    assert not joined(spawned) and process_rank(spawned, 4, "TPLA_TP") == 0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tp": 6, "node": 0, "nodes": 4}, "TPLA_TP=6 ranks do not split evenly over --nodes 4"),
        ({"tp": 8, "node": 2, "nodes": 2}, "--node 2 is outside a group of 2 hosts"),
        ({"tp": 8, "node": 1}, "--node K needs --nodes M"),
        ({"tp": 8, "node": 1, "nodes": 2, "rank": 1}, "two ways: give one"),
        ({"rank": 1}, "need --group-size"),
        ({"rank": 2, "group_size": 2}, "--rank 2 is outside a group of 2 ranks"),
    ],
)
def test_what_cannot_work_is_named(settings: dict[str, int], message: str) -> None:
    s = load_settings(group_addr="leader:29500", **settings)
    with pytest.raises(ValueError, match=message):
        membership(s, s.tp, "TPLA_TP")
