"""The router's own load (`RouterLoad`, pure bookkeeping) and the routing choices it feeds."""

from __future__ import annotations

import pytest

from common.runtime.redis_state import WorkerRecord, WorkerRole
from services.router.load import RouterLoad
from services.router.policy import KvAwarePolicy, LeastLoadedPolicy, WorkerSnapshot


def snapshot() -> WorkerSnapshot:
    """Two idle decode groups and two idle prefill workers, as a fresh registry read."""
    records = [
        WorkerRecord(g, WorkerRole.DECODE, f"{g}:1", group_id=g, kv_blocks_total=100)
        for g in ("g0", "g1")
    ]
    records += [WorkerRecord(p, WorkerRole.PREFILL, f"{p}:1") for p in ("p0", "p1")]
    return WorkerSnapshot.from_records(records)


def test_request_slots_and_the_line_are_bounded() -> None:
    load = RouterLoad(max_inflight=2, max_waiting=1, max_per_group=8)
    assert load.take_slot() and load.take_slot()
    assert not load.take_slot()
    assert (load.running, load.waiting) == (2, 0)
    assert not load.line_full()
    load.start_waiting()
    assert load.line_full() and load.waiting == 1
    load.stop_waiting()
    load.free_slot()
    assert (load.running, load.waiting) == (1, 0)
    assert load.take_slot() and load.running == 2


def test_a_group_is_full_at_the_per_group_limit() -> None:
    load = RouterLoad(max_inflight=8, max_waiting=8, max_per_group=2)
    load.join_group("g0")
    load.join_group("g1")
    assert load.full_groups() == frozenset()
    load.join_group("g0")
    assert load.full_groups() == {"g0"}
    load.leave_group("g0")
    assert load.full_groups() == frozenset()
    load.leave_group("g0")
    load.leave_group("g1")
    load.join_group("g0")
    load.join_group("g0")
    assert load.full_groups() == {"g0"}  # counted afresh after the group emptied


def test_requests_sent_count_from_the_snapshot_they_were_chosen_from() -> None:
    load = RouterLoad(max_inflight=8, max_waiting=8, max_per_group=8)
    first = snapshot()
    sent = load.sent_since(first)
    load.send_to_group(first, "g0")
    load.send_to_group(first, "g0")
    load.send_to_group(first, "g1")
    assert dict(sent) == {"g0": 2, "g1": 1}  # a live view
    assert dict(load.sent_since(first)) == {"g0": 2, "g1": 1}
    newer = snapshot()  # its reports include what was sent before it
    assert dict(load.sent_since(newer)) == {}
    load.send_to_group(newer, "g1")
    assert dict(load.sent_since(newer)) == {"g1": 1}
    with pytest.raises(TypeError):
        load.sent_since(newer)["g1"] = 0  # type: ignore[index]


def test_prefill_tokens_stay_until_the_prefill_ends() -> None:
    load = RouterLoad(max_inflight=8, max_waiting=8, max_per_group=8)
    tokens = load.prefill_tokens()
    load.start_prefill("p0", 100)
    load.start_prefill("p0", 20)
    load.start_prefill("p1", 7)
    assert dict(tokens) == {"p0": 120, "p1": 7}
    load.sent_since(snapshot())  # a registry refresh does not reset them
    load.end_prefill("p0", 100)
    load.end_prefill("p1", 7)
    assert dict(tokens) == {"p0": 20}


@pytest.mark.parametrize("policy", [LeastLoadedPolicy(), KvAwarePolicy()], ids=lambda p: p.name)
def test_a_burst_between_refreshes_spreads_over_idle_workers(policy) -> None:  # type: ignore[no-untyped-def]
    """What the policy decides from the load: each request sent since the snapshot counts
    against its decode group, each prefill in flight against its worker; a newer snapshot
    starts the decode count afresh (the ties then go to the lowest id again)."""
    load = RouterLoad(max_inflight=8, max_waiting=8, max_per_group=8)
    snap = snapshot()
    prompt = tuple(range(40))
    groups, workers = [], []
    for _ in range(4):
        group = policy.choose_decode(snap, load.sent_since(snap), prompt=prompt)
        load.send_to_group(snap, group.group_id)
        worker = policy.choose_prefill(snap, load.prefill_tokens(), prompt=prompt)
        load.start_prefill(worker.worker_id, len(prompt))
        groups.append(group.group_id)
        workers.append(worker.worker_id)
    assert groups == ["g0", "g1", "g0", "g1"]
    assert workers == ["p0", "p1", "p0", "p1"]
    newer = snapshot()
    assert policy.choose_decode(newer, load.sent_since(newer), prompt=prompt).group_id == "g0"
