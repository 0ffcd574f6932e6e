"""Prefill and decode services over real gRPC, both KV transports, a real Redis registry."""

from __future__ import annotations

import asyncio

import pytest
import redis
import torch

from common.loading.loader import load_model
from common.model.experts_kernel import select_experts_kernel
from common.model.generate import generate
from common.model.prefill_attention import select_prefill_attention
from common.parallel import ParallelConfig, ParallelMode
from common.rpc.clients import DecodeClient, PrefillClient
from common.runtime.errors import InvalidRequest
from common.runtime.ports import free_port, kv_port_offsets
from common.runtime.redis_state import WorkerRegistry, WorkerRole
from common.sampling.params import SamplingParams
from services.decode.config import EngineConfig, SpecConfig
from services.decode.rank.backends import select_decode_kernel
from services.stack.embedded_redis import EmbeddedRedis
from tests.stack import services_in_threads
from tests.tiny import save_hf

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["mla-tp", "sp"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    model_dir = tmp_path_factory.mktemp("svc-model")
    save_hf("v2-group-yarn", model_dir, std=0.08)
    parallel = (
        ParallelConfig(tp=2, latent_groups=1, mode=ParallelMode.SP, chunk_size=8)
        if request.param == "sp"
        else ParallelConfig(tp=2, latent_groups=1)
    )
    cfg = EngineConfig(
        model=str(model_dir),
        parallel=parallel,
        master_port=free_port(),
        kv_budget_mb=4,
        block_size=8,
        kv_port_base=free_port(kv_port_offsets(parallel.tp)),
        # Drafts change no token (docs/design.md §7): every answer below holds with them.
        speculative=SpecConfig("ngram"),
    )
    with (
        EmbeddedRedis(free_port()) as redis_server,
        services_in_threads(
            cfg, redis_server.url, ("grpc", "torch"), heartbeat_s=0.5, prefix_cache_mb=16.0
        ) as svc,
    ):
        yield model_dir, svc.decode, svc.prefill, redis_server


async def _run(
    decode_addr: str,
    prefill_addr: str,
    rid: str,
    prompt: list[int],
    transport: str,
    cached: int | None = None,
) -> list[int]:
    """Reserve, prefill, decode; `cached`: send the prompt ids with Reserve and expect the
    group to hold that many of its leading tokens already."""
    decode, prefill = DecodeClient(decode_addr), PrefillClient(prefill_addr)
    try:
        for _ in range(100):  # the prefill worker may still be loading
            try:
                await prefill.load()
                break
            except Exception:  # the worker is not up yet
                await asyncio.sleep(0.1)
        ids = prompt if cached is not None else ()
        res = await decode.reserve(rid, len(prompt), GREEDY.max_tokens, prompt_ids=ids)
        assert [t.rank for t in res.targets] == [0, 1]
        assert res.cached_tokens == (cached or 0)
        out = await prefill.prefill(rid, prompt, GREEDY, res, transport=transport)
        # Exactly each rank's part: its tokens (SP: its chunks) x its latent width + d_r, fp32.
        expected = 0
        for t in res.targets:
            ranges = list(zip(t.token_ranges[::2], t.token_ranges[1::2], strict=True))
            shipped = len(prompt) - res.cached_tokens
            tokens = sum(hi - lo for lo, hi in ranges) if ranges else shipped
            expected += tokens * res.num_layers * (t.latent_width + res.rope_width) * 4
        assert out.transfer_bytes == expected
        tokens = [out.first_token.token_id]
        async for event in decode.generate(rid, out.first_token, GREEDY):
            if event.token is not None:
                tokens.append(event.token.token_id)
        assert event.finish_reason == "length"
        return tokens
    finally:
        await decode.close()
        await prefill.close()


@pytest.mark.parametrize("transport", ["grpc", "torch"])
def test_disaggregated_greedy_equals_single_process(stack, transport: str) -> None:
    model_dir, decode_addr, prefills, _ = stack
    prompt = list(range(3, 40))
    expected = generate(load_model(model_dir), prompt, GREEDY).token_ids
    got = asyncio.run(_run(decode_addr, prefills[transport], f"req-{transport}", prompt, transport))
    assert got == expected


@pytest.mark.parametrize("transport", ["grpc", "torch"])
def test_prefix_reuse_ships_only_missing_blocks_and_keeps_output(stack, transport: str) -> None:
    """A prompt's full blocks stay cached after it finishes; the same prompt, and a longer one
    sharing it, reuse them (only the rest is shipped) and decode exactly as without cache."""
    model_dir, decode_addr, prefills, _ = stack
    model = load_model(model_dir)
    base = [5 + (7 * i + len(transport)) % 90 for i in range(29)]  # 3 full blocks of 8
    longer = [*base, 11, 12, 13, 14, 15, 16, 17, 18, 19]  # 38: 4 full blocks, 3 shared
    addr = prefills[transport]
    first = asyncio.run(_run(decode_addr, addr, f"p1-{transport}", base, transport, cached=0))
    again = asyncio.run(_run(decode_addr, addr, f"p2-{transport}", base, transport, cached=24))
    more = asyncio.run(_run(decode_addr, addr, f"p3-{transport}", longer, transport, cached=24))
    assert first == again == generate(model, base, GREEDY).token_ids
    assert more == generate(model, longer, GREEDY).token_ids

    async def load() -> tuple[int, int]:
        client = DecodeClient(decode_addr)
        try:
            info = await client.load()
        finally:
            await client.close()
        return info.blocks_used, info.blocks_cached

    used, cached = asyncio.run(load())
    assert used == 0 and cached >= 4  # nothing held by a live request; the prefixes stay


def test_aborts_and_failures_leave_the_cache_consistent(stack) -> None:
    """Two live reservations share the cached prefix of the prompt above (its blocks leave
    the evictable set while referenced); one prefill fails, both are aborted: nothing is
    held and exactly the same blocks are cached again."""
    _, decode_addr, prefills, _ = stack
    base = [5 + (7 * i + len("grpc")) % 90 for i in range(29)]  # cached by the test above

    async def check() -> None:
        decode, prefill = DecodeClient(decode_addr), PrefillClient(prefills["grpc"])
        try:
            before = await decode.load()
            assert before.blocks_used == 0 and before.blocks_cached >= 3
            one = await decode.reserve("share-1", len(base), 4, prompt_ids=base)
            two = await decode.reserve("share-2", len(base), 4, prompt_ids=base)
            assert one.cached_tokens == two.cached_tokens == 24
            during = await decode.load()
            assert during.blocks_cached == before.blocks_cached - 3  # referenced: not evictable
            with pytest.raises(Exception, match=r"overflows|rejected|reserve for this prompt"):
                await prefill.prefill("share-2", list(range(1, 60)), GREEDY, two)
            assert await decode.abort("share-2") and await decode.abort("share-1")
            after = await decode.load()
            assert (after.blocks_used, after.blocks_cached) == (0, before.blocks_cached)
        finally:
            await decode.close()
            await prefill.close()

    asyncio.run(check())


@pytest.mark.parametrize("transport", ["grpc", "torch"])
def test_forked_choices_over_the_services(stack, transport: str) -> None:
    """n = 3 over real gRPC: one Reserve and one Prefill (its KV pushed once over either
    transport), three first tokens, one Generate stream of indexed choices that all equal
    the single-process greedy answer; every block is free afterwards."""
    model_dir, decode_addr, prefills, _ = stack
    prompt = list(range(3, 40))  # 37 tokens: the last block of 8 is partly filled
    expected = generate(load_model(model_dir), prompt, GREEDY).token_ids

    async def run() -> list[list[int]]:
        decode, prefill = DecodeClient(decode_addr), PrefillClient(prefills[transport])
        try:
            rid = f"forked-{transport}"
            res = await decode.reserve(rid, len(prompt), GREEDY.max_tokens, n=3)
            out = await prefill.prefill(rid, prompt, GREEDY, res, transport=transport, n=3)
            tokens = [[t.token_id] for t in out.first_tokens]
            ends = {}
            async for event in decode.generate(rid, out.first_tokens, GREEDY):
                if event.token is not None:
                    tokens[event.index].append(event.token.token_id)
                if event.finish_reason is not None:
                    ends[event.index] = event.finish_reason
            assert ends == {0: "length", 1: "length", 2: "length"}
            assert (await decode.load()).blocks_used == 0
            return tokens
        finally:
            await decode.close()
            await prefill.close()

    assert asyncio.run(run()) == [expected] * 3


def test_registry_and_load(stack) -> None:
    _, decode_addr, _, redis_server = stack
    registry = WorkerRegistry(redis.Redis.from_url(redis_server.url))
    decode = [r for r in registry.list(WorkerRole.DECODE)]
    assert sorted(r.rank for r in decode) == [0, 1] and all(r.healthy for r in decode)
    assert len({r.pid for r in decode}) == 2 and decode[0].kv_blocks_total > 0
    assert len(registry.list(WorkerRole.PREFILL)) == 2

    async def check() -> None:
        client = DecodeClient(decode_addr)
        try:
            load = await client.load()
            assert (load.tp, load.latent_groups, load.blocks_used) == (2, 1, 0)
            with pytest.raises(InvalidRequest, match="context limit"):
                await client.reserve("too-long", 1000, 100)
            await client.reserve("dropped", 5, 5)
            assert (await client.load()).reserved == 1
            assert await client.abort("dropped")
            assert (await client.load()).blocks_used == 0
        finally:
            await client.close()

    asyncio.run(check())


def test_bad_shard_is_rejected_and_nothing_leaks(stack) -> None:
    """A prefill whose targets do not match the reservation fails cleanly."""
    _, decode_addr, prefills, _ = stack

    async def check() -> None:
        decode, prefill = DecodeClient(decode_addr), PrefillClient(prefills["grpc"])
        try:
            res = await decode.reserve("short", 4, 2)
            with pytest.raises(Exception, match=r"overflows|rejected|reserve for this prompt"):
                await prefill.prefill("short", list(range(1, 60)), GREEDY, res)
            assert await decode.abort("short")
            assert (await decode.load()).blocks_used == 0
        finally:
            await decode.close()
            await prefill.close()

    asyncio.run(check())


def test_worker_metrics_parse(stack) -> None:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from common.runtime.ports import METRICS_PORT_OFFSET

    _, decode_addr, prefills, _ = stack

    def scrape(address: str) -> dict[str, float]:
        host, port = address.rsplit(":", 1)
        text = httpx.get(f"http://{host}:{int(port) + METRICS_PORT_OFFSET}/metrics").text
        return {
            s.name + str(sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }

    decode = scrape(decode_addr)
    assert decode["tpla:kv_cache_usage_ratio[]"] == 0.0
    assert decode["tpla:kv_blocks_total[]"] > 0
    # Every step of the requests above is in the step-time histogram.
    assert decode["tpla:decode_step_seconds_count[]"] > 0
    assert decode["tpla:decode_step_seconds_sum[]"] > 0
    drafted, kept = (decode[f"tpla:spec_{k}_tokens_total[]"] for k in ("draft", "accepted"))
    assert 0 <= kept <= drafted
    assert (decode["tpla:spec_acceptance_length_count[]"] > 0) == (drafted > 0)
    prefill = scrape(prefills["grpc"])
    # The disaggregated tests above pushed shards through this worker.
    assert prefill["tpla:kv_transfer_bytes_total[('transport', 'grpc')]"] > 0
    # The prefix-reuse test hit both caches (tokens; queries count every looked-up token).
    for scraped in (decode, prefill):
        hits = scraped["tpla:prefix_cache_hits_total[]"]
        assert 0 < hits <= scraped["tpla:prefix_cache_queries_total[]"]
    assert decode["tpla:kv_blocks_cached[]"] > 0 and decode["tpla:kv_blocks_used[]"] == 0
    # The kernel each selector chose at start-up (fp32 on the CPU, every setting auto).
    cpu, fp32 = torch.device("cpu"), torch.float32
    native = select_decode_kernel("auto", cpu, fp32).kernel
    attention = select_prefill_attention("auto", cpu, fp32).kernel
    experts = select_experts_kernel("auto", cpu, fp32).kernel
    for scraped, chosen in (
        # The decode group prefills prompts itself when asked: the prefill worker's kernel.
        (decode, {"decode_attention": native, "prefill_attention": attention}),
        (prefill, {"prefill_attention": attention}),
    ):
        chosen |= {"fp8_gemm": "dequantize", "experts": experts}
        kernels = {k: v for k, v in scraped.items() if k.startswith("tpla:kernel_info[")}
        assert kernels == {
            f"tpla:kernel_info[('kernel', '{kernel}'), ('selector', '{selector}')]": 1.0
            for selector, kernel in chosen.items()
        }
