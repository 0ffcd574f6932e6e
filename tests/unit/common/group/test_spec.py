"""A group's rendezvous address is parsed once, with a clear error; identity fields are named
by the settings that change them; a rank's device index follows how it was started."""

from __future__ import annotations

import pytest

from common.group.join import mismatch
from common.group.spec import GroupSpec, parse_group_addr


def test_group_addresses() -> None:
    assert parse_group_addr("leader.example:29500") == ("leader.example", 29500)
    assert parse_group_addr("[::1]:29700") == ("::1", 29700)
    for bad in ("leader", ":1", "h:0", "h:x", "h:70000"):
        with pytest.raises(ValueError, match="TPLA_GROUP_ADDR"):
            parse_group_addr(bad)


def test_a_mismatch_names_the_setting() -> None:
    spec = GroupSpec("prefill", 2, settings=(("dtype", "TPLA_DTYPE"),))
    mine, leader = {"dtype": "bfloat16", "tp": "2"}, {"dtype": "float32", "tp": "2"}
    assert mismatch(spec, mine, leader) == ["TPLA_DTYPE: bfloat16 here, float32 on the leader"]
    assert mismatch(spec, {"x": "1"}, {}) == ["x: 1 here, None on the leader"]


def test_spec_shape() -> None:
    spawned = GroupSpec("prefill", 4, addr="10.0.0.1", port=29700)
    assert spawned.local_index(3) == 3 and spawned.address == "10.0.0.1:29700"
    assert "tpla prefill --rank K --group-size 4 --group-addr 10.0.0.1:29700" in (
        spawned.join_command
    )
    assert GroupSpec("decode", 4, spawned=False, collectives="dist").local_index(3) == 0
    with pytest.raises(ValueError, match="at least one rank"):
        GroupSpec("decode", 0)
    with pytest.raises(ValueError, match="not shm or dist"):
        GroupSpec("decode", 2, collectives="auto")


def test_ranks_sit_on_hosts_in_runs() -> None:
    """A group over hosts of 8 ranks each (one pod per node): host h's first rank spawns the
    other seven, each rank takes its GPU by its index on its host."""
    spec = GroupSpec("decode", 16, spawned=False, local_size=8, collectives="dist", port=29500)
    assert (spec.per_host, spec.hosts) == (8, 2)
    assert [spec.local_index(k) for k in (0, 7, 8, 15)] == [0, 7, 0, 7]
    assert list(spec.host_ranks(8)) == list(range(9, 16)) and not spec.host_ranks(9)
    assert "tpla decode --node K --nodes 2 --group-addr 127.0.0.1:29500" in spec.join_command
    spawned = GroupSpec("prefill", 4)
    assert (spawned.per_host, list(spawned.host_ranks(0))) == (4, [1, 2, 3])
    one_each = GroupSpec("decode", 4, spawned=False, collectives="dist")
    assert (one_each.per_host, list(one_each.host_ranks(2))) == (1, [])
    with pytest.raises(ValueError, match="cannot sit 3 to a host"):
        GroupSpec("decode", 16, spawned=False, local_size=3, collectives="dist")
