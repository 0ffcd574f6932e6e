"""A prefill group of two real processes with the MTP layer (TPLA_SPECULATIVE=mtp) against one
process with it: each decode rank receives the same KV, the MTP layer's latents one more layer
of it (within fp32 rounding), and each request the same first token and last hidden state,
over a prefix-cache hit, with prompts whole and in chunks; and a prompt in chunks ships the
MTP latents it does whole (a chunk's last row reads the prompt's next token)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from common.kv.transfer import make_sender
from common.loading.serving_model import load_prefill_model, load_prefill_mtp
from common.messages import PrefillResult, Reservation
from common.sampling.params import SamplingParams
from services.prefill.batch.job import PrefillJob
from services.prefill.config import PrefillGroupConfig, prefix_cache
from services.prefill.group.leader import GroupRunner
from services.prefill.group.rank_loader import load_group_rank
from services.prefill.runner import LocalRunner
from services.prefill.worker import PrefillWorker
from tests.recording_kv import Receivers, targets
from tests.shard_checkpoints import CONFIG, MTP_CONFIG, mtp_state, random_state, save_checkpoint

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
BLOCK = 16
LAYERS = CONFIG["num_hidden_layers"] + 1  # the MTP layer's cache layer last


@pytest.fixture(scope="module")
def receivers() -> Iterator[Receivers]:
    rx = Receivers()
    yield rx
    rx.close()


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, PrefillWorker]]:
    """Prefill ranks -> a worker with the MTP layer and its prefix cache (gRPC KV)."""
    main = random_state()
    path = save_checkpoint(
        {**main, **mtp_state(main, "equal")}, tmp_path_factory.mktemp("mtp-group"), **MTP_CONFIG
    )
    cfg = PrefillGroupConfig(
        model=str(path), tp=2, worker_id="mtp-two", prefix_cache_mb=16, mtp=True
    )
    model = load_prefill_model(path, None)
    runner = LocalRunner(model, make_sender("grpc", "mtp-one"), load_prefill_mtp(path, None, model))
    one = PrefillWorker(runner, prefix_cache=prefix_cache(cfg))
    two = PrefillWorker(GroupRunner.start(cfg, load_group_rank), prefix_cache=prefix_cache(cfg))
    yield {1: one, 2: two}
    one.close()
    two.close()


def _results(
    worker: PrefillWorker, tag: str, mode: str, rx: Receivers, shift: int
) -> list[PrefillResult]:
    """A prompt, then one sharing its first 32 tokens (a prefix-cache hit) batched with a
    third; decode layout `mode` over 2 ranks; `shift` moves every token id."""
    vocab, d_c = CONFIG["vocab_size"], CONFIG["kv_lora_rank"]
    base = [3 + (t * 11) % 280 for t in range(45)]
    prompts = {
        "a": base,
        "b": base[:32] + [5 + t for t in range(19)],
        "c": [9 + (t * 5) % 270 for t in range(26)],
    }
    jobs = []
    for name, ids in prompts.items():
        ids = [(t + shift) % vocab for t in ids]
        kv = targets(mode, 2, d_c, len(ids), 0, rx.address)
        res = Reservation(f"{tag}-{name}", BLOCK, 0, 0, "float32", 30.0, kv, 0)
        jobs.append(PrefillJob(res.request_id, ids, GREEDY, res, 30.0))
    first = worker.submit(jobs[0]).result(timeout=60)
    return [first, *(f.result(timeout=60) for f in [worker.submit(j) for j in jobs[1:]])]


@pytest.mark.parametrize("chunk", [0, 7])
@pytest.mark.parametrize("mode", ["tpla", "sp"])
def test_a_two_rank_group_ships_the_mtp_latents_one_process_does(
    workers: dict[int, PrefillWorker], receivers: Receivers, mode: str, chunk: int
) -> None:
    shift = {("tpla", 0): 0, ("sp", 0): 41, ("tpla", 7): 83, ("sp", 7): 127}[(mode, chunk)]
    results = {}
    for tp, worker in workers.items():
        was, worker.chunk_tokens = worker.chunk_tokens, chunk
        try:
            results[tp] = _results(worker, f"p{tp}-{mode}-{chunk}", mode, receivers, shift)
        finally:
            worker.chunk_tokens = was
    for one, two in zip(results[1], results[2], strict=True):
        assert two.first_token.token_id == one.first_token.token_id
        assert two.first_token.logprob == pytest.approx(one.first_token.logprob, abs=1e-5)
        assert len(one.hidden) == CONFIG["hidden_size"]
        assert two.hidden == pytest.approx(one.hidden, abs=1e-5)
        assert two.cached_tokens == one.cached_tokens
        assert two.transfer_bytes == one.transfer_bytes
    assert results[2][1].cached_tokens >= 32
    for name in "abc":
        for rank in range(2):
            want = receivers.caches[(f"p1-{mode}-{chunk}-{name}", rank)].kv
            got = receivers.caches[(f"p2-{mode}-{chunk}-{name}", rank)].kv
            assert want.shape[0] == LAYERS
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunked", [1, 2])
def test_chunks_ship_the_mtp_latents_of_the_whole_prompt(
    workers: dict[int, PrefillWorker], receivers: Receivers, chunked: int
) -> None:
    """One worker in chunks of 7 against the other whole (two workers: neither's prefix
    cache holds the other's latents): every row of every layer alike, the MTP layer's at
    the chunks' last rows included."""
    shift = {1: 171, 2: 213}[chunked]
    for tp, worker in workers.items():
        was, worker.chunk_tokens = worker.chunk_tokens, 7 if tp == chunked else 0
        try:
            _results(worker, f"c{chunked}-{tp}", "tpla", receivers, shift)
        finally:
            worker.chunk_tokens = was
    for name in "abc":
        for rank in range(2):
            whole = receivers.caches[(f"c{chunked}-{3 - chunked}-{name}", rank)].kv
            chunks = receivers.caches[(f"c{chunked}-{chunked}-{name}", rank)].kv
            torch.testing.assert_close(chunks, whole, rtol=1e-4, atol=1e-5)
