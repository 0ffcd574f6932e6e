"""An idle prefill group lives: its leader pings the ranks while no batch runs, so a group of
two whose collective timeout is 3 s stays up through 10 s without work and answers after
(the default timeout is 120 s; this test sets its own). A leader that hangs (neither a plan
nor a ping within the timeout) is named by its follower, which exits 1 without a traceback."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.group.errors import RankExited
from common.messages import PrefillResult, Reservation
from common.sampling.params import SamplingParams
from services.prefill.batch.job import PrefillJob
from services.prefill.config import PrefillGroupConfig
from services.prefill.group.leader import GroupRunner
from services.prefill.group.rank_loader import load_group_rank
from services.prefill.worker import PrefillWorker
from tests.recording_kv import Receivers, targets
from tests.tiny import save_hf

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
TIMEOUT_S = 3.0
PROMPT = [3 + (t * 11) % 300 for t in range(21)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("idle-prefill")
    save_hf("v2-greedy", out, vocab_size=321)
    return out


@pytest.fixture
def receivers() -> Iterator[Receivers]:
    rx = Receivers()
    yield rx
    rx.close()


def _prefill(worker: PrefillWorker, rx: Receivers, rid: str) -> PrefillResult:
    d_c = worker.runner.config.kv_lora_rank
    kv = targets("tpla", 2, d_c, len(PROMPT), 0, rx.address)
    job = PrefillJob(rid, PROMPT, GREEDY, Reservation(rid, 16, 0, 0, "float32", 30.0, kv), 30.0)
    return worker.submit(job).result(timeout=60)


def _group(model_dir: Path) -> GroupRunner:
    cfg = PrefillGroupConfig(model=str(model_dir), tp=2, collective_timeout_s=TIMEOUT_S)
    return GroupRunner.start(cfg, load_group_rank)


def test_an_idle_group_outlives_its_collective_timeout(
    model_dir: Path, receivers: Receivers
) -> None:
    worker = PrefillWorker(_group(model_dir))
    try:
        before = _prefill(worker, receivers, "before")
        time.sleep(10.0)  # over three collective timeouts without a batch
        worker.runner.check()
        assert worker.runner.failed is None
        after = _prefill(worker, receivers, "after")
        assert after.first_token.token_id == before.first_token.token_id
        assert after.transfer_bytes == before.transfer_bytes
    finally:
        worker.close()


def test_a_follower_names_a_leader_that_hangs(
    model_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    runner = _group(model_dir)
    try:
        # The leader holds its collectives (no plan, no ping) past the followers' timeout.
        with runner._collectives:
            deadline = time.monotonic() + 60
            while all(runner.processes.alive()) and time.monotonic() < deadline:
                time.sleep(0.2)
        with pytest.raises(RankExited, match="prefill rank 1 exited with code 1"):
            runner.processes.check()
        err = capfd.readouterr().err
        assert (
            f"prefill rank 1: neither a plan nor a ping from the group's leader within "
            f"{TIMEOUT_S:g} s (the collective timeout)"
        ) in err
        assert err.rstrip().endswith("; exiting") or "; exiting\n" in err
        assert "Traceback" not in err
    finally:
        runner.close()
