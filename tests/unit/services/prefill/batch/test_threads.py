"""The prefill thread policy: which batches get more threads, its bounds, that it restores the
caller's thread count, and that a prefill worker runs its batches on it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.kv.transfer import make_sender
from common.loading.serving_model import load_prefill_model
from common.messages import Reservation
from common.runtime.settings import load_settings
from common.sampling.params import SamplingParams
from services.prefill.batch import threads
from services.prefill.batch.job import PrefillJob
from services.prefill.batch.threads import PrefillThreads
from services.prefill.runner import LocalRunner
from services.prefill.worker import PrefillWorker
from tests.tiny import save_hf

# A reservation with no KV targets: the prefill runs, nothing is shipped.
NO_TARGETS = Reservation("", 16, 0, 0, "float32", 30.0, ())


def test_large_batches_get_the_larger_count() -> None:
    policy = PrefillThreads(base=1, large=2, min_tokens=512)
    assert [policy.for_tokens(n) for n in (1, 511, 512, 4096)] == [1, 1, 2, 2]


def test_from_settings_stays_within_torch_threads_and_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def policy(torch_threads: int, prefill_threads: int) -> PrefillThreads:
        s = load_settings(torch_threads=torch_threads, prefill_threads=prefill_threads)
        return PrefillThreads.from_settings(s)

    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    assert policy(1, 2) == PrefillThreads(1, 2)
    assert policy(1, 8).large == 2  # never more threads than cores
    assert policy(4, 2).large == 4  # never fewer than torch_threads
    monkeypatch.setattr(threads, "usable_cores", lambda: 1)
    assert policy(1, 2) == PrefillThreads(1, 1)


def test_bad_counts_are_refused() -> None:
    for bad in ((0, 2), (1, 0)):
        with pytest.raises(ValueError, match=">= 1"):
            PrefillThreads(*bad)
    with pytest.raises(ValueError, match=">= 1"):
        PrefillThreads(1, 2, min_tokens=0)


def test_applied_sets_the_count_and_restores_it_even_after_an_error() -> None:
    before = torch.get_num_threads()
    other = before + 1
    policy = PrefillThreads(base=before, large=other, min_tokens=10)
    with policy.applied(10) as threads:
        assert threads == other == torch.get_num_threads()
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="boom"), policy.applied(100):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before
    with policy.applied(3) as threads:  # a small batch keeps the caller's count
        assert threads == before == torch.get_num_threads()


def test_a_prefill_worker_runs_each_batch_on_its_thread_count(tmp_path: Path) -> None:
    save_hf("v2-greedy", tmp_path, vocab_size=320)
    model = load_prefill_model(tmp_path, None)
    seen: list[tuple[int, int]] = []
    prefill = model.prefill

    def recording(ids: torch.Tensor, lens: list[int], **kw: object):  # type: ignore[no-untyped-def]
        seen.append((len(ids), torch.get_num_threads()))
        return prefill(ids, lens, **kw)

    model.prefill = recording  # type: ignore[method-assign]
    policy = PrefillThreads(base=1, large=2, min_tokens=16)
    worker = PrefillWorker(LocalRunner(model, make_sender("grpc", "test")), threads=policy)
    reference = PrefillWorker(
        LocalRunner(load_prefill_model(tmp_path, None), make_sender("grpc", "ref"))
    )
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    try:
        for n in (4, 40):
            # No KV targets: the job ends after its prefill and first token, nothing is sent.
            job = PrefillJob(f"r{n}", list(range(3, 3 + n)), greedy, NO_TARGETS, 10.0)
            done = worker.submit(job).result(timeout=60)
            want = reference.submit(job).result(timeout=60)
            assert done.first_token.token_id == want.first_token.token_id
    finally:
        worker.close()
        reference.close()
    assert seen == [(4, 1), (40, 2)]


def test_the_local_stack_lets_a_threaded_prefill_worker_sleep_while_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.stack.serve import _env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert "OMP_WAIT_POLICY" not in _env(load_settings(prefill_threads=1), "redis://x")
    env = _env(load_settings(torch_threads=1, prefill_threads=2), "redis://x")
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["TPLA_PREFILL_THREADS"] == "2"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # an explicit choice is kept
    assert _env(load_settings(prefill_threads=2), "redis://x")["OMP_WAIT_POLICY"] == "ACTIVE"
