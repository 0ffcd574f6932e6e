"""The prefill worker's latent prefix cache: a prompt that shares a cached prefix computes only
its new tokens, yet ships exactly what a prefill without the cache ships of whatever part the
decode group lacks (TPLA column shards and SP token ranges alike). The sender records the
shards; the transports run for real in tests/integration."""

from __future__ import annotations

import pytest
import torch

from common.kv.prefix_cache import model_identity
from common.kv.transfer import KvSender, Shard
from common.loading.serving_model import load_prefill_model
from common.messages import KvTargetInfo, Reservation
from common.sampling.params import SamplingParams
from services.prefill.batch.job import PrefillJob
from services.prefill.batch.latent_cache import LatentPrefixCache
from services.prefill.runner import LocalRunner
from services.prefill.worker import PrefillWorker
from tests.tiny import save_hf

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
PROMPT = [3 + (11 * t) % 300 for t in range(40)]


class RecordingSender(KvSender):
    name = "recording"

    def __init__(self) -> None:
        self.shards: dict[tuple[str, int], Shard] = {}

    def send(self, shard: Shard, grpc_address: str, torch_address: str, deadline_s: float) -> int:
        self.shards[(shard.request_id, shard.rank)] = shard
        return shard.nbytes


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp("prefill-cache")
    save_hf("v2-greedy", out, vocab_size=320)
    return out, load_prefill_model(out, None)


def _tpla(model, skip: int) -> tuple[KvTargetInfo, ...]:  # type: ignore[no-untyped-def]
    width = model.config.kv_lora_rank // 2
    blocks = tuple(range(skip // 8, 5))
    return tuple(KvTargetInfo(r, "a:1", "", r * width, width, blocks) for r in range(2))


def _sp(model, skip: int) -> tuple[KvTargetInfo, ...]:  # type: ignore[no-untyped-def]
    """Chunks of 8 over two ranks; the ranges start after the decode group's prefix."""
    d_c = model.config.kv_lora_rank
    owned = [[(s, s + 8) for s in range(r * 8, 40, 16)] for r in range(2)]
    return tuple(
        KvTargetInfo(
            r,
            "a:1",
            "",
            0,
            d_c,
            (),
            tuple(x for lo, hi in owned[r] if hi > skip for x in (max(lo, skip), hi)) or (0, 0),
        )
        for r in range(2)
    )


def _job(rid: str, targets: tuple[KvTargetInfo, ...], skip: int) -> PrefillJob:
    """PROMPT into blocks of 8 of a decode group that holds its first `skip` tokens."""
    reservation = Reservation(rid, 8, 0, 0, "", 30.0, targets, skip)
    return PrefillJob(rid, PROMPT, GREEDY, reservation, 30.0)


@pytest.mark.parametrize("layout", [_tpla, _sp])
def test_cached_prefix_ships_what_the_decode_group_lacks(model, layout) -> None:  # type: ignore[no-untyped-def]
    model_dir, net = model
    plain_sender, cached_sender = RecordingSender(), RecordingSender()
    plain = PrefillWorker(LocalRunner(net, plain_sender))
    cache = LatentPrefixCache(model_identity(model_dir, None), 2**24, block_size=16)
    cached = PrefillWorker(LocalRunner(net, cached_sender), prefix_cache=cache)
    try:
        jobs = {
            "cold": (cached, 0),  # fills the cache with blocks [0, 32)
            "warm-decode-has-16": (cached, 16),  # prefill hit 32 > 16: 16..31 from the cache
            "warm-decode-has-none": (cached, 0),
            "warm-decode-has-40": (cached, 40),  # nothing to ship
        }
        done = {}
        for rid, (worker, skip) in jobs.items():
            job = _job(rid, layout(net, skip), skip)
            done[rid] = worker.submit(job).result(timeout=60)
        ref = plain.submit(_job("ref", layout(net, 0), 0)).result(60)
    finally:
        plain.close()
        cached.close()
    assert done["cold"].cached_tokens == 0
    for rid in ("warm-decode-has-16", "warm-decode-has-none", "warm-decode-has-40"):
        assert done[rid].cached_tokens == 32 and len(cache) == 2
        assert done[rid].first_token.token_id == ref.first_token.token_id
    for rank in range(2):
        full = plain_sender.shards[("ref", rank)].kv
        torch.testing.assert_close(cached_sender.shards[("cold", rank)].kv, full)
        torch.testing.assert_close(cached_sender.shards[("warm-decode-has-none", rank)].kv, full)
        tail = cached_sender.shards[("warm-decode-has-16", rank)].kv
        # Rows of positions >= 16 in the rank's order (SP: its own chunks).
        skipped = full.shape[1] - tail.shape[1]
        assert skipped == (16 if layout is _tpla else 8)
        torch.testing.assert_close(tail, full[:, skipped:], atol=2e-5, rtol=1e-4)
        assert ("warm-decode-has-40", rank) not in cached_sender.shards


def test_latent_cache_stays_within_its_budget_least_recently_used_first() -> None:
    layers, bs, width = 2, 4, 6
    block_bytes = layers * bs * width * 4  # fp32
    cache = LatentPrefixCache(root=1, budget_bytes=3 * block_bytes, block_size=bs)

    def latents(tokens: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        n = [torch.randn(tokens, 4, generator=g) for _ in range(layers)]
        return n, [torch.randn(tokens, 2, generator=g) for _ in range(layers)]

    a, b = list(range(13)), [50 + t for t in range(9)]  # 3 and 2 full blocks
    n_a, k_a = latents(13, 0)
    cache.store(cache.hashes(a), n_a, k_a, first=0, rows=0)
    assert len(cache) == 3 and cache.bytes == 3 * block_bytes
    past = cache.lookup(cache.hashes(a), len(a))
    assert past is not None and past.length == 12
    torch.testing.assert_close(past.n[1], n_a[1][:12])
    torch.testing.assert_close(past.k_pe[0], k_a[0][:12])
    # A prompt of exactly 12 tokens reuses at most 8: its last token is always computed.
    assert cache.lookup(cache.hashes(a[:12]), 12).length == 8  # type: ignore[union-attr]
    n_b, k_b = latents(9, 1)
    cache.store(cache.hashes(b), n_b, k_b, first=0, rows=0)  # evicts a's two oldest
    assert len(cache) == 3 and cache.bytes <= 3 * block_bytes
    # a's chain was touched parents last, so its deepest blocks went first: block 0 remains.
    kept = cache.lookup(cache.hashes(a), len(a))
    assert kept is not None and kept.length == 4
    assert cache.lookup(cache.hashes(b), len(b)).length == 8  # type: ignore[union-attr]
    assert cache.lookup(cache.hashes([7, *a[1:]]), 13) is None  # another first block
