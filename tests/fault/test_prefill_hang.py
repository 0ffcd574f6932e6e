"""A prefill rank that hangs (stopped, alive) is caught by the group's collective timeout:
the batch fails as UNAVAILABLE (another prefill worker may serve it), the group counts as
failed and refuses later batches at once."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from common.kv.transfer import TransferError
from common.messages import KvTargetInfo, Reservation
from common.runtime.errors import Unavailable
from common.sampling.params import SamplingParams
from services.prefill.batch.job import PrefillJob
from services.prefill.config import PrefillGroupConfig
from services.prefill.group.leader import GroupRunner
from services.prefill.group.rank_loader import load_group_rank
from services.prefill.worker import PrefillWorker
from tests.tiny import save_hf

TIMEOUT_S = 3.0


def _job(rid: str) -> PrefillJob:
    targets = (KvTargetInfo(0, "127.0.0.1:9", "", 0, 8, (0, 1)),)
    res = Reservation(rid, 16, 0, 0, "float32", 30.0, targets)
    return PrefillJob(rid, list(range(3, 20)), SamplingParams(temperature=0.0), res, 30.0)


def test_a_hung_rank_fails_the_batch_within_the_collective_timeout(tmp_path: Path) -> None:
    save_hf("v2-greedy", tmp_path, vocab_size=320)
    cfg = PrefillGroupConfig(model=str(tmp_path), tp=2, collective_timeout_s=TIMEOUT_S)
    runner = GroupRunner.start(cfg, load_group_rank)
    worker = PrefillWorker(runner)
    [follower] = [
        p
        for p in psutil.Process().children()
        if "services.prefill.group.follower" in " ".join(p.cmdline())
    ]
    try:
        os.kill(follower.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(Unavailable, match="group failed"):
            worker.submit(_job("hung")).result(timeout=60)
        assert time.monotonic() - started < TIMEOUT_S + 10
        assert runner.failed is not None
        with pytest.raises((Unavailable, TransferError), match="group has failed"):
            worker.submit(_job("after")).result(timeout=10)
    finally:
        os.kill(follower.pid, signal.SIGKILL)
        worker.close()
