"""DeepSeek Sparse Attention served disaggregated: a prompt past index_topk prefilled in
chunks of 5 tokens (each chunk's latents and indexer keys shipped as it is computed) over
real gRPC and both KV transports into MLA-TP, SP and TPLA decode groups, with and without a
prefix the decode group holds already: greedy equal to the single-process model (MLA-TP, SP)
and to the same layout's in-process engine (TPLA, an approximation by design)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from common.loading.loader import load_model
from common.loading.serving_model import load_prefill_model
from common.model.generate import generate
from common.parallel import ParallelConfig, ParallelMode
from common.runtime.ports import free_port, kv_port_offsets
from common.sampling.params import SamplingParams
from services.decode.config import EngineConfig
from services.decode.engine import DecodeEngine
from tests.stack import reserve_prefill_generate, services_in_threads
from tests.tiny import save_hf
from tools.local_driver import collect, submit

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LAYOUTS = {
    "mla-tp": ParallelConfig(tp=2),
    "sp": ParallelConfig(tp=2, mode=ParallelMode.SP, chunk_size=8),
    "tpla": ParallelConfig(tp=2, latent_groups=2),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dsa-svc-model")
    save_hf("glm-shared", path)
    return path


def _config(model_dir: Path, parallel: ParallelConfig, kv_port: int | None) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        parallel=parallel,
        master_port=free_port(),
        kv_budget_mb=4,
        block_size=8,
        kv_port_base=kv_port,
    )


TRANSPORTS = ("grpc", "torch")


def _prompts(transport: str) -> tuple[list[int], list[int]]:
    """29 tokens (3 full blocks of 8), and 42 sharing those 3 blocks; apart per transport."""
    base = [5 + (7 * i + len(transport)) % 90 for i in range(29)]
    return base, [*base, *range(11, 24)]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def stack(request: pytest.FixtureRequest, model_dir: Path):  # type: ignore[no-untyped-def]
    """The layout's services, and its reference tokens (computed first: an in-process engine
    and the served group cannot share this process's default process group)."""
    prompts = [p for t in TRANSPORTS for p in _prompts(t)]
    tokens = _reference(model_dir, request.param, prompts)
    expected = {t: tokens[2 * k : 2 * k + 2] for k, t in enumerate(TRANSPORTS)}
    parallel = LAYOUTS[request.param]
    cfg = _config(model_dir, parallel, free_port(kv_port_offsets(parallel.tp)))
    with services_in_threads(cfg, None, TRANSPORTS, prefix_cache_mb=16.0, chunk_tokens=5) as svc:
        yield expected, svc.decode, svc.prefill


def _reference(model_dir: Path, layout: str, prompts: list[list[int]]) -> list[list[int]]:
    if layout != "tpla":
        model = load_model(model_dir)
        return [generate(model, p, GREEDY).token_ids for p in prompts]
    with DecodeEngine(_config(model_dir, LAYOUTS[layout], None)) as engine:
        prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
        return [collect(*submit(engine, prefill, [p], [GREEDY])[0]).token_ids for p in prompts]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_served_greedy_equals_the_reference(stack, transport: str) -> None:  # type: ignore[no-untyped-def]
    expected, decode_addr, prefills = stack
    addr = prefills[transport]
    base, longer = _prompts(transport)
    first, held, _ = asyncio.run(
        reserve_prefill_generate(decode_addr, addr, f"d1-{transport}", base, GREEDY, transport)
    )
    assert held == 0
    more, held, _ = asyncio.run(
        reserve_prefill_generate(decode_addr, addr, f"d2-{transport}", longer, GREEDY, transport)
    )
    assert held == 24  # the decode group's blocks hold the prefix's latents and keys
    assert [first, more] == expected[transport]
