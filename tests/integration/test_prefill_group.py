"""A prefill group of two real processes against one process: for every decode layout (TPLA
r=2, MLA-TP, SP) and decode group size (1, 2, 4), over both KV transports, each decode rank
receives the same KV (within fp32 rounding: the ranks' partial sums add in another order)
and the request the same first token. One tp=2 group per transport
serves the whole matrix; the decode ranks are recording KV receivers in this process, one
gRPC server (and one torch store) for all of them. A tp=2 group that prefills in chunks
(7 and 16 tokens, KV blocks of 16) ships what a tp=1 worker computing prompts whole does, and
a chunked prompt dropped between its chunks leaves nothing held on the follower rank."""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from common.kv.transfer import make_sender
from common.loading.serving_model import load_prefill_model
from common.messages import PrefillResult, Reservation
from common.sampling.params import SamplingParams
from services.prefill.batch.job import PrefillJob
from services.prefill.batch.job_trace import JobTrace
from services.prefill.config import PrefillGroupConfig, prefix_cache
from services.prefill.group.leader import GroupRunner
from services.prefill.group.rank_loader import load_group_rank
from services.prefill.runner import LocalRunner
from services.prefill.worker import PrefillWorker
from tests.recording_kv import Receivers, targets
from tests.tiny import save_hf

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
BLOCK = 16
VOCAB = 321  # an uneven vocabulary split
LAYOUTS = [
    (mode, tp)
    for mode in ("tpla", "mla-tp", "sp")
    for tp in (1, 2, 4)
    if not (mode == "tpla" and tp < 2)
]


@dataclass(frozen=True)
class Workers:
    transport: str
    by_tp: dict[int, PrefillWorker]  # prefill ranks -> its worker


def _jobs(
    tag: str, mode: str, tp: int, d_c: int, rx: Receivers, shift: int = 0
) -> list[PrefillJob]:
    """A prompt, one sharing its first 32 tokens (a prefix-cache hit), one whose first block
    the decode group holds, and one asking for its prompt's logprobs (every position's
    logits); `shift` moves every token id (other prompts, the same shapes)."""
    base = [3 + (t * 11) % 300 for t in range(48)]
    prompts = [
        ("a", base, 0, None),
        ("b", base[:32] + [5 + t for t in range(21)], 0, None),
        ("c", [9 + (t * 5) % 290 for t in range(40)], BLOCK, None),
        ("d", [4 + (t * 3) % 280 for t in range(19)], 0, 2),
    ]
    jobs = []
    for name, ids, cached, logprobs in prompts:
        ids = [(t + shift) % VOCAB for t in ids]
        rid = f"{tag}-{mode}-{tp}-{name}"
        kv = targets(mode, tp, d_c, len(ids), cached, rx.address, rx.torch_address)
        res = Reservation(rid, BLOCK, 0, 0, "float32", 30.0, kv, cached)
        jobs.append(PrefillJob(rid, ids, GREEDY, res, 30.0, prompt_logprobs=logprobs))
    return jobs


def _run(worker: PrefillWorker, jobs: list[PrefillJob]) -> list[PrefillResult]:
    # a and b in order (b hits a's blocks), then c and d batched together.
    first = [worker.submit(job).result(timeout=60) for job in jobs[:2]]
    return first + [f.result(timeout=60) for f in [worker.submit(job) for job in jobs[2:]]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prefill-group")
    save_hf("v2-greedy", out, vocab_size=VOCAB)
    return out


@pytest.fixture(scope="module")
def receivers() -> Iterator[Receivers]:
    rx = Receivers(torch_pairs=True)
    yield rx
    rx.close()


@pytest.fixture(scope="module", params=["grpc", "torch"])
def workers(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[Workers]:
    """A tp=1 worker and a tp=2 one on one KV transport, each with its prefix cache."""
    transport = request.param
    cfg = PrefillGroupConfig(
        model=str(model_dir), tp=2, worker_id="two", prefix_cache_mb=16, transport=transport
    )
    one = PrefillWorker(
        LocalRunner(load_prefill_model(model_dir, None), make_sender(transport, "one")),
        prefix_cache=prefix_cache(cfg),
    )
    two = PrefillWorker(GroupRunner.start(cfg, load_group_rank), prefix_cache=prefix_cache(cfg))
    yield Workers(transport, {1: one, 2: two})
    one.close()
    two.close()


@pytest.mark.parametrize(("mode", "tp"), LAYOUTS)
def test_a_two_rank_prefill_group_ships_what_one_process_does(
    workers: Workers, receivers: Receivers, mode: str, tp: int
) -> None:
    d_c = workers.by_tp[1].runner.config.kv_lora_rank
    results = {
        ptp: _run(worker, _jobs(f"p{ptp}-{workers.transport}", mode, tp, d_c, receivers))
        for ptp, worker in workers.by_tp.items()
    }
    for one, two in zip(results[1], results[2], strict=True):
        assert two.first_token.token_id == one.first_token.token_id
        assert two.first_token.logprob == pytest.approx(one.first_token.logprob, abs=1e-5)
        assert [t.token_id for t in two.prompt_logprobs] == [
            t.token_id for t in one.prompt_logprobs
        ]
        assert [t.logprob for t in two.prompt_logprobs] == pytest.approx(
            [t.logprob for t in one.prompt_logprobs], abs=1e-5
        )
        assert two.transfer_bytes == one.transfer_bytes
    # Both caches saw the same prompts: b reuses a's blocks (later layouts: every prompt
    # that was seen before).
    assert [r.cached_tokens for r in results[2]] == [r.cached_tokens for r in results[1]]
    assert results[2][1].cached_tokens >= 32
    for name in "abcd":
        for rank in range(tp):
            want = receivers.caches.get((f"p1-{workers.transport}-{mode}-{tp}-{name}", rank))
            got = receivers.caches.get((f"p2-{workers.transport}-{mode}-{tp}-{name}", rank))
            assert (want is None) == (got is None), (name, rank)
            if want is not None and got is not None:
                torch.testing.assert_close(got.kv, want.kv, rtol=1e-4, atol=1e-5)


@contextmanager
def _chunking(workers: Workers, chunk: int) -> Iterator[tuple[PrefillWorker, PrefillWorker]]:
    """The tp=1 worker computing prompts whole and the tp=2 group chunking them by `chunk`
    (its follower rank takes each prompt's chunk from its first piece), for one test."""
    one, two = workers.by_tp[1], workers.by_tp[2]
    was = one.chunk_tokens, two.chunk_tokens
    one.chunk_tokens, two.chunk_tokens = 0, chunk
    try:
        yield one, two
    finally:
        one.chunk_tokens, two.chunk_tokens = was


@pytest.mark.parametrize("chunk", [7, 16])
@pytest.mark.parametrize("mode", ["tpla", "sp"])
def test_a_chunking_prefill_group_ships_what_one_whole_prompt_process_does(
    workers: Workers, receivers: Receivers, mode: str, chunk: int
) -> None:
    tag = f"c{chunk}-{workers.transport}"
    shift = 1 + zlib.crc32(f"{tag}-{mode}".encode()) % 300  # prompts no earlier test cached
    with _chunking(workers, chunk) as (one, two):
        d_c = one.runner.config.kv_lora_rank
        want = _run(one, _jobs(f"{tag}-1", mode, 2, d_c, receivers, shift))
        got = _run(two, _jobs(f"{tag}-2", mode, 2, d_c, receivers, shift))
    for w, g in zip(want, got, strict=True):
        assert g.first_token.token_id == w.first_token.token_id
        assert g.first_token.logprob == pytest.approx(w.first_token.logprob, abs=1e-5)
        assert [t.token_id for t in g.prompt_logprobs] == [t.token_id for t in w.prompt_logprobs]
        assert g.cached_tokens == w.cached_tokens
    assert got[1].cached_tokens >= 32
    for name in "abcd":
        for rank in range(2):
            w_kv = receivers.caches[(f"{tag}-1-{mode}-2-{name}", rank)].kv
            g_kv = receivers.caches[(f"{tag}-2-{mode}-2-{name}", rank)].kv
            torch.testing.assert_close(g_kv, w_kv, rtol=1e-4, atol=1e-5)
    assert _held(two, 0) == 0  # every finished prompt forgotten


class _Paused(JobTrace):
    """Holds the batcher after the job's first piece until `resume` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.resume = threading.Event(), threading.Event()

    def batched(
        self, start_ns: int, seconds: float, jobs: int, tokens: int, computed: int, reused: int
    ) -> None:
        super().batched(start_ns, seconds, jobs, tokens, computed, reused)
        if not self.first.is_set():
            self.first.set()
            assert self.resume.wait(30)


def _held(worker: PrefillWorker, want: int) -> int:
    """The prompts the follower rank holds, once it says `want` (or after 30 s): it reports
    after its piece's sends began, not in step with the leader."""
    runner = worker.runner
    assert isinstance(runner, GroupRunner)
    deadline, got = time.monotonic() + 30, -1
    while time.monotonic() < deadline and (got := runner.reports.held(1)) != want:
        time.sleep(0.02)
    return got


def test_a_prompt_dropped_between_chunks_leaves_nothing_on_the_follower(
    workers: Workers, receivers: Receivers
) -> None:
    with _chunking(workers, 7) as (_, two):
        d_c = two.runner.config.kv_lora_rank
        tag = f"drop-{workers.transport}"
        long, short = _jobs(tag, "tpla", 2, d_c, receivers, 301)[2:4]
        trace = _Paused()
        fut = two.submit(replace(long, trace=trace))
        assert trace.first.wait(30)
        assert _held(two, 1) == 1  # its first chunk's latents
        assert fut.cancel()  # the client left between its chunks
        trace.resume.set()
        two.submit(short).result(timeout=60)  # the next plan names the dropped prompt
        assert _held(two, 0) == 0
