"""Shared-memory collectives between real processes: results, chunking, failures."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from common.native import shm_group
from common.native.shm_group import CollectiveError, ShmGroup
from common.runtime import group_files

pytestmark = pytest.mark.skipif(not shm_group.available(), reason="native library unavailable")

SLOT = 1024  # small slots, so the larger messages below take several rounds


def _peer(path: str, rank: int, world: int, script: str, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    g = ShmGroup(path, rank, world, SLOT, 10.0, False)
    try:
        # numpy arrays travel by value (a torch tensor would share a file descriptor that is
        # gone once this process exits)
        out.put((rank, [t.numpy() for t in _run(g, script)]))
    finally:
        g.close()


def _run(g: ShmGroup, script: str) -> list:
    r = g.rank
    results = []
    if script == "all":
        t = torch.arange(1000, dtype=torch.float32) * (r + 1)  # 4000 bytes: 4 rounds
        g.all_reduce_(t)
        results.append(t.clone())
        m = torch.tensor([float(r), -float(r), 7.0])
        g.all_reduce_(m, "max")
        results.append(m)
        b = torch.arange(700, dtype=torch.int64) if r == 0 else torch.zeros(700, dtype=torch.int64)
        g.broadcast_(b)
        results.append(b)
        gathered = g.all_gather(torch.full((3, 300), float(r)))
        results.append(gathered)
        to_root = g.gather(torch.full((500,), float(r)), 1)  # 2000 bytes: 2 rounds
        assert (to_root is None) == (r != 1)
        results.append(to_root if to_root is not None else torch.zeros(3, 500))
        h = torch.ones(64, dtype=torch.bfloat16) * (r + 1)
        g.all_reduce_(h)
        results.append(h.float())
    elif script == "sync-then-hang":
        g.all_reduce_(torch.ones(4))
        time.sleep(60)  # never arrives at the next round (killed by the test)
    return results


def _group(world: int, script: str) -> tuple[str, list[mp.Process], mp.Queue]:
    path = group_files.new_path()
    ShmGroup(path, 0, world, SLOT, 10.0, True).close()
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [
        ctx.Process(target=_peer, args=(path, rank, world, script, out), daemon=True)
        for rank in range(1, world)
    ]
    for p in procs:
        p.start()
    return path, procs, out


def test_collectives_agree_across_three_ranks() -> None:
    path, procs, out = _group(3, "all")
    try:
        g = ShmGroup(path, 0, 3, SLOT, 30.0, False)
        mine = _run(g, "all")
        g.close()
        others = dict(out.get(timeout=60) for _ in procs)
    finally:
        os.unlink(path)
        for p in procs:
            p.join(timeout=30)
    base = torch.arange(1000, dtype=torch.float32)
    torch.testing.assert_close(mine[0], base * 6)
    assert mine[1].tolist() == [2.0, 0.0, 7.0]
    assert mine[2].tolist() == list(range(700))
    assert mine[3].shape == (3, 3, 300) and [float(x[0, 0]) for x in mine[3]] == [0.0, 1.0, 2.0]
    assert mine[5].tolist() == [6.0] * 64
    root = torch.from_numpy(others[1][4])  # gathered on rank 1 only
    assert [float(row[0]) for row in root] == [0.0, 1.0, 2.0] and root.shape == (3, 500)
    for rank in (1, 2):  # bit-identical on every rank
        for i, (a, b) in enumerate(zip(mine, others[rank], strict=True)):
            if i != 4:
                assert torch.equal(a, torch.from_numpy(b))


def test_a_dead_peer_fails_the_waiting_rank_promptly() -> None:
    path, procs, _ = _group(2, "sync-then-hang")
    try:
        g = ShmGroup(path, 0, 2, SLOT, 60.0, False)
        g.all_reduce_(torch.ones(4))  # both attached and in step
        os.kill(procs[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(CollectiveError, match="died"):
            g.all_reduce_(torch.ones(4))
        assert time.monotonic() - start < 5.0  # not the 60 s timeout
        g.close()
    finally:
        os.unlink(path)
        procs[0].join(timeout=10)


def test_a_missing_peer_times_out() -> None:
    path = group_files.new_path()
    g = ShmGroup(path, 0, 2, SLOT, 0.3, True)
    try:
        start = time.monotonic()
        with pytest.raises(CollectiveError, match="timed out"):
            g.all_reduce_(torch.ones(4))
        assert time.monotonic() - start < 3.0
    finally:
        g.close()
        os.unlink(path)


def test_attaching_to_a_missing_or_mismatched_group_fails() -> None:
    with pytest.raises(CollectiveError, match="cannot attach"):
        ShmGroup("/dev/shm/tpla-group-does-not-exist", 1, 2, SLOT, 1.0, False)
    path = group_files.new_path()
    ShmGroup(path, 0, 2, SLOT, 1.0, True).close()
    try:
        with pytest.raises(CollectiveError, match="cannot attach"):
            ShmGroup(path, 1, 3, SLOT, 1.0, False)  # another world size
        with pytest.raises(CollectiveError, match="cannot attach"):
            ShmGroup(path, 0, 2, SLOT, 1.0, True)  # exists already
    finally:
        os.unlink(path)
