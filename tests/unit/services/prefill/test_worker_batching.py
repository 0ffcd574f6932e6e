"""The prefill worker's batches: queued prompts in arrival order up to a token budget, a
prompt longer than the budget alone, the prompt that did not fit first in the next batch,
and every job answered as if it had run by itself."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from common.kv.transfer import make_sender
from common.loading.serving_model import load_prefill_model
from common.messages import Reservation
from common.sampling.params import SamplingParams
from services.prefill.batch.job import PrefillJob
from services.prefill.runner import LocalRunner
from services.prefill.worker import PrefillWorker
from tests.tiny import save_hf

# A reservation with no KV targets: the prefill runs, nothing is shipped.
NO_TARGETS = Reservation("", 16, 0, 0, "float32", 30.0, ())


def test_batches_fill_the_token_budget_in_arrival_order(tmp_path: Path) -> None:
    save_hf("v2-greedy", tmp_path, vocab_size=320)
    model = load_prefill_model(tmp_path, None)
    prefill = model.prefill
    batches: list[list[int]] = []
    release = threading.Event()

    def gated(ids: torch.Tensor, lens: list[int], **kw: object):  # type: ignore[no-untyped-def]
        batches.append(list(lens))
        # The first batch waits until every later job is queued, so what they are batched
        # with depends only on the budget, not on timing.
        assert release.wait(timeout=60)
        return prefill(ids, lens, **kw)

    model.prefill = gated  # type: ignore[method-assign]
    worker = PrefillWorker(LocalRunner(model, make_sender("grpc", "test")), max_batch_tokens=100)
    alone = PrefillWorker(
        LocalRunner(load_prefill_model(tmp_path, None), make_sender("grpc", "ref"))
    )
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    lengths = [10, 40, 40, 60, 30, 150, 5]
    jobs = [
        PrefillJob(f"r{i}", [3 + (i * 7 + t) % 300 for t in range(n)], greedy, NO_TARGETS, 30.0)
        for i, n in enumerate(lengths)
    ]
    try:
        futures = [worker.submit(jobs[0])]
        deadline = time.monotonic() + 60
        while not batches:  # the first job is taken alone, before the others arrive
            assert time.monotonic() < deadline, "the worker never took the first job"
            time.sleep(0.01)
        futures += [worker.submit(job) for job in jobs[1:]]
        assert worker.queued_requests == len(jobs) - 1
        release.set()
        done = [f.result(timeout=60) for f in futures]
        want = [alone.submit(job).result(timeout=60) for job in jobs]
    finally:
        release.set()
        worker.close()
        alone.close()
    # 40 + 40 fit 100; 60 does not join them and opens the next batch with 30; 150 exceeds
    # the budget and runs alone; 5 follows it.
    assert batches == [[10], [40, 40], [60, 30], [150], [5]]
    assert [d.first_token.token_id for d in done] == [w.first_token.token_id for w in want]
    assert worker.queued_requests == 0


def test_a_budget_below_one_token_is_refused(tmp_path: Path) -> None:
    save_hf("v2-greedy", tmp_path, vocab_size=320)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        PrefillWorker(LocalRunner(load_prefill_model(tmp_path, None), make_sender("grpc", "t")), 0)
