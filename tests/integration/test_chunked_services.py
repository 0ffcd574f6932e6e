"""Prompts prefilled in chunks of 5 tokens (KV blocks of 8) over real gRPC and both KV
transports, each chunk shipped as it is computed: the decode group places every chunk's rows
and decodes exactly what a single process generates, in MLA-TP and SP layouts, with and
without a prefix the decode group holds already."""

from __future__ import annotations

import asyncio

import pytest

from common.loading.loader import load_model
from common.model.generate import generate
from common.parallel import ParallelConfig, ParallelMode
from common.runtime.ports import free_port, kv_port_offsets
from common.sampling.params import SamplingParams
from services.decode.config import EngineConfig
from tests.stack import reserve_prefill_generate, services_in_threads
from tests.tiny import save_hf

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["mla-tp", "sp"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    model_dir = tmp_path_factory.mktemp("chunk-svc-model")
    save_hf("v3-noaux-yarn", model_dir, std=0.08)
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
    )
    with services_in_threads(
        cfg, None, ("grpc", "torch"), prefix_cache_mb=16.0, chunk_tokens=5
    ) as svc:
        yield model_dir, svc.decode, svc.prefill


@pytest.mark.parametrize("transport", ["grpc", "torch"])
def test_chunked_prefill_decodes_like_one_process(stack, transport: str) -> None:  # type: ignore[no-untyped-def]
    model_dir, decode_addr, prefills = stack
    model = load_model(model_dir)
    base = [5 + (7 * i + len(transport)) % 90 for i in range(29)]  # 3 full blocks of 8
    longer = [*base, *range(11, 24)]  # 42 tokens, 3 blocks shared with `base`
    addr = prefills[transport]
    first, held, out = asyncio.run(
        reserve_prefill_generate(decode_addr, addr, f"c1-{transport}", base, GREEDY, transport)
    )
    assert held == 0 and out.exposed_transfer_seconds > 0
    more, held, _ = asyncio.run(
        reserve_prefill_generate(decode_addr, addr, f"c2-{transport}", longer, GREEDY, transport)
    )
    assert held == 24  # the decode group holds 3 blocks: 18 tokens shipped, from position 24
    assert first == generate(model, base, GREEDY).token_ids
    assert more == generate(model, longer, GREEDY).token_ids
