"""The prefill worker ships KV without stopping: a batch's shards travel (all jobs, all ranks
at once) while the next batch is prefilled, each job resolves when its own shards are
acknowledged, a failed push fails only its job, and closing fails the jobs whose pushes never
started instead of leaving them waiting.

The sender here is a recording, gated stand-in for the transport: what is under test is the
worker's scheduling; the transports themselves run for real in tests/integration (the
services, the torch pairs and the kv-transfer bench)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.kv.transfer import KvSender, Shard, TransferError, make_sender
from common.loading.serving_model import load_prefill_model
from common.messages import KvTargetInfo, Reservation
from common.sampling.params import SamplingParams
from services.prefill.batch.job import PrefillJob
from services.prefill.runner import LocalRunner
from services.prefill.worker import PrefillWorker
from tests.tiny import save_hf

WAIT_S = 60.0
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


class GatedSender(KvSender):
    """Records every send and holds it until `release` is set; `fail` names requests whose
    sends raise TransferError."""

    name = "gated"

    def __init__(self, fail: frozenset[str] = frozenset()) -> None:
        self.release = threading.Event()
        self.fail = fail
        self.started: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def send(self, shard: Shard, grpc_address: str, torch_address: str, deadline_s: float) -> int:
        with self._lock:
            self.started.append((shard.request_id, shard.rank))
        if shard.request_id in self.fail:
            raise TransferError(f"rank {shard.rank} refused {shard.request_id}")
        assert self.release.wait(timeout=WAIT_S), "the test never released the sends"
        return shard.nbytes

    def wait_started(self, count: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while len(self.started) < count:
            assert time.monotonic() < deadline, f"only {self.started} of {count} sends started"
            time.sleep(0.01)


def _job(model, request_id: str, length: int, seed: int) -> PrefillJob:  # type: ignore[no-untyped-def]
    width = model.config.kv_lora_rank // 2
    blocks = tuple(range(-(-length // 16)))
    targets = tuple(
        KvTargetInfo(rank, f"127.0.0.1:{9 + rank}", "", rank * width, width, blocks)
        for rank in range(2)
    )
    ids = [3 + (seed * 7 + t) % 300 for t in range(length)]
    reservation = Reservation(request_id, 16, 0, 0, "float32", 30.0, targets)
    return PrefillJob(request_id, ids, GREEDY, reservation, 30.0)


@pytest.fixture
def model(tmp_path: Path):  # type: ignore[no-untyped-def]
    save_hf("v2-greedy", tmp_path, vocab_size=320)
    return load_prefill_model(tmp_path, None)


def test_the_next_batch_is_prefilled_while_shards_travel(model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    prefill = model.prefill
    batches: list[list[int]] = []

    def recorded(ids: torch.Tensor, lens: list[int], **kw: object):  # type: ignore[no-untyped-def]
        batches.append(list(lens))
        return prefill(ids, lens, **kw)

    model.prefill = recorded  # type: ignore[method-assign]
    sender = GatedSender()
    worker = PrefillWorker(LocalRunner(model, sender))
    alone = PrefillWorker(
        LocalRunner(load_prefill_model(tmp_path, None), make_sender("grpc", "ref"))
    )
    first, second = _job(model, "a", 40, 1), _job(model, "b", 24, 2)
    try:
        a = worker.submit(first)
        sender.wait_started(2)  # both ranks' shards of "a" are on their way, held
        b = worker.submit(second)
        sender.wait_started(4)  # so "b" was prefilled and shipped meanwhile
        assert batches == [[40], [24]]
        assert not a.done() and not b.done()
        sender.release.set()
        done = [a.result(timeout=WAIT_S), b.result(timeout=WAIT_S)]
        # The reference worker ships to no rank: only the first token is compared.
        want = [
            alone.submit(replace(j, reservation=replace(j.reservation, targets=()))).result(
                timeout=WAIT_S
            )
            for j in (first, second)
        ]
    finally:
        sender.release.set()
        worker.close()
        alone.close()
    assert sorted(sender.started) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert [d.first_token.token_id for d in done] == [w.first_token.token_id for w in want]
    layers, d_r = model.config.num_hidden_layers, model.config.qk_rope_head_dim
    width = model.config.kv_lora_rank // 2
    for d, n in zip(done, (40, 24), strict=True):
        assert d.transfer_bytes == 2 * layers * n * (width + d_r) * 4
    assert worker.transfer_bytes_total == sum(d.transfer_bytes for d in done)


def test_a_failed_push_fails_only_its_job(model) -> None:  # type: ignore[no-untyped-def]
    sender = GatedSender(fail=frozenset({"bad"}))
    sender.release.set()
    worker = PrefillWorker(LocalRunner(model, sender))
    try:
        # Submitted together, so they are usually one batch; either way the result is the same.
        bad = worker.submit(_job(model, "bad", 20, 3))
        good = worker.submit(_job(model, "good", 20, 4))
        with pytest.raises(TransferError, match="refused bad"):
            bad.result(timeout=WAIT_S)
        assert good.result(timeout=WAIT_S).transfer_bytes > 0
    finally:
        worker.close()


def test_closing_fails_jobs_whose_push_never_started(model) -> None:  # type: ignore[no-untyped-def]
    sender = GatedSender()
    worker = PrefillWorker(LocalRunner(model, sender))
    jobs = [_job(model, f"r{i}", 16, i) for i in range(5)]
    try:
        futures = [worker.submit(job) for job in jobs]
        # 8 pusher threads: four jobs' sends run (held), the fifth job's two wait in the queue.
        sender.wait_started(8)
        deadline = time.monotonic() + WAIT_S
        while worker.queued_requests:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # close() joins the batcher before it stops the pool, so the last job's sends are
        # queued by then and are the ones cancelled.
        worker.close()
        with pytest.raises(TransferError, match="closed"):
            futures[4].result(timeout=WAIT_S)
    finally:
        sender.release.set()
    # The sends already running finish and answer their jobs.
    assert all(f.result(timeout=WAIT_S).transfer_bytes > 0 for f in futures[:4])
