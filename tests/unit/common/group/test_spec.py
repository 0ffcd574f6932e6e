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
