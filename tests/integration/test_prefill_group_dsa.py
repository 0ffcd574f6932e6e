"""DeepSeek Sparse Attention in a prefill group: two real processes prefilling prompts past
index_topk (whole, or in chunks of 7 with a prefix-cache hit) ship each decode layout's ranks
the latents and indexer keys, and give the first tokens, that one process computing each
prompt whole does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.kv.transfer import make_sender
from common.loading.serving_model import load_prefill_model
from common.messages import PrefillResult, Reservation
from common.sampling.params import SamplingParams
from services.prefill.batch.job import PrefillJob
from services.prefill.config import PrefillGroupConfig, prefix_cache
from services.prefill.group.leader import GroupRunner
from services.prefill.group.rank_loader import load_group_rank
from services.prefill.runner import LocalRunner
from services.prefill.worker import PrefillWorker
from tests.recording_kv import Receivers, targets
from tests.tiny import save_hf

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prefill-group-dsa")
    save_hf("glm-shared", out)
    return out


@pytest.fixture(scope="module")
def receivers() -> Iterator[Receivers]:
    rx = Receivers()
    yield rx
    rx.close()


@pytest.fixture(scope="module")
def workers(model_dir: Path) -> Iterator[tuple[PrefillWorker, PrefillWorker]]:
    cfg = PrefillGroupConfig(model=str(model_dir), tp=2, worker_id="dsa-two", prefix_cache_mb=16)
    one = PrefillWorker(
        LocalRunner(load_prefill_model(model_dir, None), make_sender("grpc", "dsa-one")),
        prefix_cache=prefix_cache(cfg),
        chunk_tokens=0,
    )
    two = PrefillWorker(
        GroupRunner.start(cfg, load_group_rank), prefix_cache=prefix_cache(cfg), chunk_tokens=7
    )
    yield one, two
    one.close()
    two.close()


def _jobs(tag: str, mode: str, d_c: int, rx: Receivers) -> list[PrefillJob]:
    """A prompt, and one sharing its first 32 tokens (a prefix-cache hit)."""
    base = [3 + (t * 11) % 150 for t in range(45)]
    jobs = []
    for name, ids in (("a", base), ("b", base[:32] + [5 + t for t in range(14)])):
        rid = f"{tag}-{mode}-{name}"
        kv = targets(mode, 2, d_c, len(ids), 0, rx.address)
        res = Reservation(rid, BLOCK, 0, 0, "float32", 30.0, kv, 0)
        jobs.append(PrefillJob(rid, ids, GREEDY, res, 30.0))
    return jobs


def _run(worker: PrefillWorker, jobs: list[PrefillJob]) -> list[PrefillResult]:
    return [worker.submit(job).result(timeout=60) for job in jobs]


@pytest.mark.parametrize("mode", ["mla-tp", "tpla", "sp"])
def test_a_chunking_group_ships_what_one_process_does(
    workers: tuple[PrefillWorker, PrefillWorker], receivers: Receivers, mode: str
) -> None:
    one, two = workers
    d_c = one.runner.config.kv_lora_rank
    want = _run(one, _jobs("one", mode, d_c, receivers))
    got = _run(two, _jobs("two", mode, d_c, receivers))
    assert got[1].cached_tokens >= 32
    for w, g in zip(want, got, strict=True):
        assert g.first_token.token_id == w.first_token.token_id
        assert g.first_token.logprob == pytest.approx(w.first_token.logprob, abs=1e-5)
    for name in "ab":
        for rank in range(2):
            for caches in (receivers.caches, receivers.index_caches):
                w_kv = caches[(f"one-{mode}-{name}", rank)].kv
                g_kv = caches[(f"two-{mode}-{name}", rank)].kv
                torch.testing.assert_close(g_kv, w_kv, rtol=1e-4, atol=1e-5)
