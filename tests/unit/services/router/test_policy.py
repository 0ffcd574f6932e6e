"""Routing policies over registry snapshots (pure logic)."""

from __future__ import annotations

import pytest

from common.kv.prefix_cache import block_hashes, format_hashes, root_hash
from common.runtime.errors import Unavailable
from common.runtime.redis_state import WorkerRecord, WorkerRole
from services.router.policy import (
    KvAwarePolicy,
    LeastLoadedPolicy,
    RoundRobinPolicy,
    WorkerSnapshot,
    make_policy,
)


def decode(
    group: str, rank: int = 0, used: int = 0, total: int = 100, **kw: object
) -> WorkerRecord:
    return WorkerRecord(
        f"{group}-r{rank}",
        WorkerRole.DECODE,
        f"{group}:1",
        rank=rank,
        group_id=group,
        kv_blocks_used=used,
        kv_blocks_total=total,
        **kw,  # type: ignore[arg-type]
    )


def prefill(name: str, queued: int = 0, healthy: bool = True) -> WorkerRecord:
    return WorkerRecord(
        name, WorkerRole.PREFILL, f"{name}:1", queued_tokens=queued, healthy=healthy
    )


SNAP = WorkerSnapshot.from_records(
    [
        decode("g1", used=80),
        decode("g1", rank=1),
        decode("g2", used=30),
        decode("g2", rank=1),
        prefill("p1", queued=500),
        prefill("p2", queued=100),
        prefill("p3", queued=0, healthy=False),
    ]
)


def test_snapshot_groups_are_leaders_only() -> None:
    assert [(g.group_id, g.address, g.free_blocks) for g in SNAP.decode_groups] == [
        ("g1", "g1:1", 20),
        ("g2", "g2:1", 70),
    ]
    assert SNAP.not_ready_reason() is None


def test_least_loaded_picks_most_free_blocks_and_fewest_queued_tokens() -> None:
    policy = LeastLoadedPolicy()
    assert policy.choose_decode(SNAP, {}).group_id == "g2"
    assert policy.choose_prefill(SNAP, {}).worker_id == "p2"  # p3 is idle but unhealthy
    # Tokens this router has in flight at a worker count when its report is older.
    assert policy.choose_prefill(SNAP, {"p2": 1000}).worker_id == "p1"
    # ... but are part of what the report already shows, not added to it: p1 reports 500
    # queued and 300 of them are this router's, p2 reports 100 and has 400 in flight.
    assert policy.choose_prefill(SNAP, {"p1": 300, "p2": 400}).worker_id == "p2"
    # A stale report of an idle worker does not win over this router's own burst there.
    assert policy.choose_prefill(SNAP, {"p2": 600}).worker_id == "p1"
    # Excluded groups (full, or quarantined after a failure) are skipped.
    assert policy.choose_decode(SNAP, {}, frozenset({"g2"})).group_id == "g1"
    with pytest.raises(Unavailable):
        policy.choose_decode(SNAP, {}, frozenset({"g1", "g2"}))
    # Excluding the worker that just failed (the retry path).
    assert LeastLoadedPolicy().choose_prefill(SNAP, {}, frozenset({"p2"})).worker_id == "p1"


def test_group_with_an_unhealthy_rank_is_skipped() -> None:
    snap = WorkerSnapshot.from_records(
        [decode("g1"), decode("g1", rank=1, healthy=False), decode("g2", used=99), prefill("p")]
    )
    assert LeastLoadedPolicy().choose_decode(snap, {}).group_id == "g2"


def test_round_robin_cycles() -> None:
    policy = make_policy("round-robin")
    assert isinstance(policy, RoundRobinPolicy)
    groups = [policy.choose_decode(SNAP, {}).group_id for _ in range(4)]
    workers = [policy.choose_prefill(SNAP, {}).worker_id for _ in range(4)]
    assert groups == ["g1", "g2", "g1", "g2"]
    assert workers == ["p1", "p2", "p1", "p2"]


def test_no_workers_is_unavailable() -> None:
    empty = WorkerSnapshot()
    assert empty.not_ready_reason() == "no healthy decode group or prefill worker is registered"
    for policy in (LeastLoadedPolicy(), RoundRobinPolicy()):
        with pytest.raises(Unavailable, match="decode"):
            policy.choose_decode(empty, {})
        only_decode = WorkerSnapshot.from_records([decode("g1")])
        assert only_decode.not_ready_reason() is None  # it prefills itself: degraded
        with pytest.raises(Unavailable, match="prefill"):
            policy.choose_prefill(only_decode, {})
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")


def test_kv_aware_weighs_prefix_overlap_against_load() -> None:
    root = root_hash("tiny")
    prompt = list(range(64))  # 4 blocks of 16
    chain = block_hashes(root, prompt, 16)

    def group(name: str, used: int, cached: int) -> WorkerRecord:
        return decode(
            name,
            used=used,
            block_size=16,
            prefix_root=f"{root:x}",
            prefix_hashes=format_hashes(chain[:cached]),
        )

    snap = WorkerSnapshot.from_records(
        [group("g1", used=10, cached=4), group("g2", used=8, cached=0), prefill("p1")]
    )
    assert snap.decode_groups[0].prefix.cached_tokens(prompt, {}) == 64
    policy = make_policy("kv-aware", overlap_weight=1.0)
    assert isinstance(policy, KvAwarePolicy)
    # g1 holds the whole prompt: 0 blocks to receive + 10 held < 4 + 8.
    assert policy.choose_decode(snap, {}, prompt=prompt).group_id == "g1"
    # Without a prompt (or with another one) load decides.
    assert policy.choose_decode(snap, {}).group_id == "g2"
    assert policy.choose_decode(snap, {}, prompt=[9] * 64).group_id == "g2"
    # Load outweighs overlap once g1 is busy enough; a higher weight favours overlap again.
    busy = WorkerSnapshot.from_records(
        [group("g1", used=30, cached=4), group("g2", used=8, cached=0)]
    )
    assert policy.choose_decode(busy, {}, prompt=prompt).group_id == "g2"
    heavy = KvAwarePolicy(overlap_weight=8.0)
    assert heavy.choose_decode(busy, {}, prompt=prompt).group_id == "g1"
    # Requests this router sent since the snapshot count as load (a burst spreads out).
    assert policy.choose_decode(snap, {"g1": 2}, prompt=prompt).group_id == "g2"
    # A different chain root (another model or side file) never matches.
    other = WorkerSnapshot.from_records(
        [
            decode(
                "g1",
                used=10,
                block_size=16,
                prefix_root=f"{root_hash('x'):x}",
                prefix_hashes=format_hashes(chain),
            ),
            group("g2", used=8, cached=0),
        ]
    )
    assert policy.choose_decode(other, {}, prompt=prompt).group_id == "g2"


def test_kv_aware_sends_a_prompt_to_the_prefill_worker_holding_its_prefix() -> None:
    root = root_hash("tiny-prefill")
    prompt = list(range(100))
    chain = block_hashes(root, prompt, 16)  # 6 full blocks: 96 tokens

    def worker(name: str, queued: int, cached: int) -> WorkerRecord:
        return WorkerRecord(
            name,
            WorkerRole.PREFILL,
            f"{name}:1",
            queued_tokens=queued,
            block_size=16,
            prefix_root=f"{root:x}",
            prefix_hashes=format_hashes(chain[:cached]),
        )

    snap = WorkerSnapshot.from_records([worker("p1", 50, 6), worker("p2", 0, 0)])
    policy = KvAwarePolicy()
    # p1: 50 queued + 4 to compute < p2: 0 + 100.
    assert policy.choose_prefill(snap, {}, prompt=prompt).worker_id == "p1"
    assert policy.choose_prefill(snap, {}).worker_id == "p2"  # no prompt: load alone
    busy = WorkerSnapshot.from_records([worker("p1", 500, 6), worker("p2", 0, 0)])
    assert policy.choose_prefill(busy, {}, prompt=prompt).worker_id == "p2"
    # This router's tokens in flight count as queued there.
    assert policy.choose_prefill(snap, {"p1": 400}, prompt=prompt).worker_id == "p2"
    # Least-loaded ignores the prefix.
    assert LeastLoadedPolicy().choose_prefill(snap, {}, prompt=prompt).worker_id == "p2"


def test_draining_workers_get_no_new_work() -> None:
    """A worker told to go (its record says draining) is healthy but takes nothing new: every
    policy passes it over, and with nothing else left the router has no worker."""
    draining = WorkerRecord("p9", WorkerRole.PREFILL, "p9:1", draining=True)
    snap = WorkerSnapshot.from_records(
        [decode("g1", draining=True), decode("g1", rank=1), decode("g2", used=90), draining]
    )
    assert [g.group_id for g in snap.healthy_groups()] == ["g2"]
    assert snap.healthy_prefill() == []
    for policy in (LeastLoadedPolicy(), KvAwarePolicy(), RoundRobinPolicy()):
        assert policy.choose_decode(snap, {}).group_id == "g2"
    alone = WorkerSnapshot.from_records([decode("g1", draining=True), draining])
    with pytest.raises(Unavailable):
        LeastLoadedPolicy().choose_decode(alone, {})
    assert alone.not_ready_reason() == "no healthy decode group or prefill worker is registered"


def test_the_draining_flag_survives_redis() -> None:
    record = decode("g1", draining=True)
    assert record.to_redis()["draining"] == "1"
    assert WorkerRecord.from_redis(record.to_redis()) == record
    assert not WorkerRecord.from_redis(decode("g1").to_redis()).draining
