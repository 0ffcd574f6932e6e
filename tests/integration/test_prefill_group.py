"""A prefill group of two real processes against one process: for every decode layout (TPLA
r=2, MLA-TP, SP) and decode group size (1, 2, 4), over both KV transports, each decode rank
receives the same KV (within fp32 rounding: the ranks' partial sums add in another order)
and the request the same first token. One tp=2 group per transport
serves the whole matrix; the decode ranks are recording KV receivers in this process, one
gRPC server (and one torch store) for all of them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from common.kv.transfer import make_sender
from common.loading.serving_model import load_prefill_model
from common.messages import PrefillResult, Reservation
from common.sampling.params import SamplingParams
from services.prefill.group.config import PrefillGroupConfig, prefix_cache
from services.prefill.group.leader import GroupRunner
from services.prefill.group.rank_model import load_group_rank
from services.prefill.runner import LocalRunner
from services.prefill.worker import PrefillJob, PrefillWorker
from tests.recording_kv import Receivers, targets
from tests.tiny import save_hf

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
BLOCK = 16
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


def _jobs(tag: str, mode: str, tp: int, d_c: int, rx: Receivers) -> list[PrefillJob]:
    """A prompt, one sharing its first 32 tokens (a prefix-cache hit), one whose first block
    the decode group holds, and one asking for its prompt's logprobs (every position's
    logits)."""
    base = [3 + (t * 11) % 300 for t in range(48)]
    prompts = [
        ("a", base, 0, None),
        ("b", base[:32] + [5 + t for t in range(21)], 0, None),
        ("c", [9 + (t * 5) % 290 for t in range(40)], BLOCK, None),
        ("d", [4 + (t * 3) % 280 for t in range(19)], 0, 2),
    ]
    jobs = []
    for name, ids, cached, logprobs in prompts:
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
    save_hf("v2-greedy", out, vocab_size=321)  # an uneven vocabulary split
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
