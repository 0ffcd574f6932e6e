"""Chunked prefill in the worker: a prompt longer than the chunk runs one chunk per batch and
ships what the same prompt prefilled whole ships (latents within fp32 tolerance, the same
first token), with chunks that split a KV block and ones that do not, the prefix cache on
and off; short prompts go between a long prompt's chunks; a cancelled prompt computes no
more chunks.

The sender records the shards instead of sending them: the transports run for real in
tests/integration."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.kv.transfer import KvSender, Shard
from common.kv.wire import shard_slots
from common.loading.serving_model import load_prefill_model
from common.messages import KvTargetInfo, PrefillResult, Reservation
from common.sampling.params import SamplingParams
from services.prefill.batch.job import PrefillJob
from services.prefill.batch.job_trace import JobTrace
from services.prefill.batch.latent_cache import LatentPrefixCache
from services.prefill.runner import LocalRunner
from services.prefill.worker import PrefillWorker
from tests.tiny import save_hf

WAIT_S = 60.0
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
NO_TARGETS = Reservation("", 16, 0, 0, "float32", 30.0, ())


class RecordingSender(KvSender):
    """Places every shard's rows where the receiver would (`shard_slots` of its header) in a
    pool per request; sends nothing."""

    name = "recording"

    def __init__(self) -> None:
        self.kv: dict[str, torch.Tensor] = {}
        self.shards: dict[str, int] = {}

    def send(self, shard: Shard, grpc_address: str, torch_address: str, deadline_s: float) -> int:
        layers, _, width = shard.kv.shape
        pool = self.kv.setdefault(shard.request_id, torch.full((layers, 64 * 16, width), -7.0))
        pool[:, shard_slots(shard.header())] = shard.kv
        self.shards[shard.request_id] = self.shards.get(shard.request_id, 0) + 1
        return shard.nbytes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("chunk-model")
    save_hf("v3-noaux-yarn", out, std=0.08)
    return out


def _job(model, request_id: str, ids: list[int], cached: int = 0, logprobs: int | None = None):  # type: ignore[no-untyped-def]
    d_c = model.config.kv_lora_rank
    blocks = tuple(range(cached // 16, -(-len(ids) // 16)))
    target = KvTargetInfo(0, "127.0.0.1:9", "", 0, d_c, blocks)
    reservation = Reservation(request_id, 16, 0, 0, "float32", 30.0, (target,), cached)
    return PrefillJob(request_id, ids, GREEDY, reservation, 30.0, prompt_logprobs=logprobs)


def _run(
    model_dir: Path, chunk: int, cache: bool, jobs_of
) -> tuple[list[PrefillResult], RecordingSender]:  # type: ignore[no-untyped-def]
    model = load_prefill_model(model_dir, None)
    sender = RecordingSender()
    prefix = LatentPrefixCache(7, 1 << 24) if cache else None
    worker = PrefillWorker(LocalRunner(model, sender), 64, chunk_tokens=chunk, prefix_cache=prefix)
    try:
        # One after another, so a later prompt finds an earlier one's blocks in the cache.
        results = [worker.submit(job).result(timeout=WAIT_S) for job in jobs_of(model)]
    finally:
        worker.close()
    return results, sender


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(2, 150, (40,), generator=g).tolist()
    return [
        shared + torch.randint(2, 150, (70,), generator=g).tolist(),
        shared + torch.randint(2, 150, (29,), generator=g).tolist(),  # reuses 32 cached
        torch.randint(2, 150, (9,), generator=g).tolist(),  # one piece
    ]


def _jobs(model):  # type: ignore[no-untyped-def]
    a, b, c = _prompts()
    return [_job(model, "a", a), _job(model, "b", b, cached=16), _job(model, "c", c, logprobs=2)]


@pytest.fixture(scope="module")
def whole(model_dir: Path):  # type: ignore[no-untyped-def]
    return _run(model_dir, 0, False, _jobs)


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("chunk", [16, 23, 7])
def test_chunked_ships_what_a_whole_prefill_ships(
    model_dir: Path, whole, chunk: int, cache: bool
) -> None:  # type: ignore[no-untyped-def]
    want, want_sent = whole
    got, got_sent = _run(model_dir, chunk, cache, _jobs)
    want_kv, got_kv = want_sent.kv, got_sent.kv
    for g, w in zip(got, want, strict=True):
        assert g.first_token.token_id == w.first_token.token_id
        torch.testing.assert_close(g.first_token.logprob, w.first_token.logprob, atol=1e-5, rtol=0)
        assert [t.token_id for t in g.prompt_logprobs] == [t.token_id for t in w.prompt_logprobs]
    assert got[1].cached_tokens == (32 if cache else 0)
    assert set(got_kv) == set(want_kv)
    for rid, kv in want_kv.items():
        torch.testing.assert_close(got_kv[rid], kv, atol=2e-5, rtol=1e-4)
    # Each chunk of the long prompts shipped as it was computed.
    assert want_sent.shards == {"a": 1, "b": 1, "c": 1}
    assert got_sent.shards["a"] == -(-110 // chunk) and got_sent.shards["c"] == -(-9 // chunk)
    # Only the last chunk's push is exposed; the first chunk's started before it.
    assert 0 < got[0].exposed_transfer_seconds <= got[0].transfer_seconds


def test_a_chunked_prompts_trace_spans_its_chunks(model_dir: Path) -> None:
    trace = JobTrace()
    prompt = _prompts()[0]
    _run(model_dir, 16, False, lambda m: [replace(_job(m, "t", prompt), trace=trace)])
    assert trace.computed_tokens == len(prompt) and trace.reused_tokens == 0
    assert trace.batch_start_ns < trace.batch_end_ns
    assert len(trace.pushes) == -(-len(prompt) // 16)  # one push a chunk to the one rank


def test_chunked_prompt_logprobs_equal_whole(model_dir: Path) -> None:
    prompt = _prompts()[0]
    want, _ = _run(model_dir, 0, False, lambda m: [_job(m, "p", prompt, logprobs=3)])
    got, _ = _run(model_dir, 16, False, lambda m: [_job(m, "p", prompt, logprobs=3)])
    assert len(got[0].prompt_logprobs) == len(prompt) - 1
    for g, w in zip(got[0].prompt_logprobs, want[0].prompt_logprobs, strict=True):
        assert g.token_id == w.token_id
        assert [a for a, _ in g.top_logprobs] == [a for a, _ in w.top_logprobs]
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)


class Gated:
    """Wraps model.prefill: records each batch's piece lengths and whether `short` was done
    then; the first batch waits for `release`."""

    def __init__(self, model) -> None:  # type: ignore[no-untyped-def]
        self.prefill = model.prefill
        self.release = threading.Event()
        self.batches: list[tuple[list[int], bool]] = []
        self.short: Future[PrefillResult] | None = None
        model.prefill = self

    def __call__(self, ids: torch.Tensor, lens: list[int], **kw: object):  # type: ignore[no-untyped-def]
        self.batches.append((list(lens), self.short is not None and self.short.done()))
        assert self.release.wait(timeout=WAIT_S)
        return self.prefill(ids, lens, **kw)

    def wait_batches(self, count: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while len(self.batches) < count:
            assert time.monotonic() < deadline, f"only {self.batches} batches"
            time.sleep(0.01)


def test_a_short_prompt_goes_between_a_long_prompts_chunks(model_dir: Path) -> None:
    model = load_prefill_model(model_dir, None)
    gate = Gated(model)
    worker = PrefillWorker(LocalRunner(model, RecordingSender()), 64, chunk_tokens=16)
    try:
        long = worker.submit(PrefillJob("long", [5] * 80, GREEDY, NO_TARGETS, 30.0))
        gate.wait_batches(1)  # the long prompt's first chunk is being computed
        gate.short = worker.submit(PrefillJob("short", [6] * 10, GREEDY, NO_TARGETS, 30.0))
        gate.release.set()
        long.result(timeout=WAIT_S)
        gate.short.result(timeout=WAIT_S)
    finally:
        gate.release.set()
        worker.close()
    # The short prompt shares the second batch with the long prompt's second chunk and has
    # its first token before the long prompt's last chunk is computed.
    assert [lens for lens, _ in gate.batches] == [[16], [10, 16], [16], [16], [16]]
    assert gate.batches[-1][1]
    assert worker.queued_tokens == 0


def test_a_cancelled_prompt_computes_no_more_chunks(model_dir: Path) -> None:
    model = load_prefill_model(model_dir, None)
    gate = Gated(model)
    worker = PrefillWorker(LocalRunner(model, RecordingSender()), 64, chunk_tokens=16)
    try:
        long = worker.submit(PrefillJob("long", [5] * 80, GREEDY, NO_TARGETS, 30.0))
        gate.wait_batches(1)
        assert long.cancel()  # the client left while its first chunk was computed
        gate.release.set()
        after = worker.submit(PrefillJob("after", [6] * 10, GREEDY, NO_TARGETS, 30.0))
        after.result(timeout=WAIT_S)
    finally:
        gate.release.set()
        worker.close()
    assert [lens for lens, _ in gate.batches] == [[16], [10]]
    assert worker.queued_tokens == 0
