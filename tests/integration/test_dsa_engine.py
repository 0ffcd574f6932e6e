"""DeepSeek Sparse Attention in the decode engine (real multi-process groups on loopback): a
prompt past index_topk decodes the single-process model's greedy tokens in MLA-TP and in SP
(the group refusing to prefill it itself: its prefill pass writes no indexer keys),
on the native and torch backends (dense steps on the backend's kernel, sparse ones on the
gathered rows), and TPLA with one latent group is MLA-TP; with speculation (n-gram drafts,
or the MTP module's, whose layer runs its own indexer) every verify row selects over its
own causal past and the tokens stay the plain ones; the fp8 index-key format serves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.loading.loader import load_model
from common.loading.serving_model import load_prefill_model, load_prefill_mtp
from common.model.generate import generate
from common.parallel import ParallelConfig, ParallelMode
from common.runtime.errors import LocalPrefillOff
from common.runtime.kernel_choice import KernelConfig
from common.sampling.params import SamplingParams
from services.decode.config import EngineConfig, SpecConfig
from services.decode.engine import DecodeEngine
from tests.tiny import add_mtp_layer, save_hf
from tools.local_driver import collect, submit

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["v32-sparse", "glm-shared"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    save_hf(request.param, path)
    return path


def _engine(model_dir: Path, parallel: ParallelConfig, kernel: str, **kw: object) -> DecodeEngine:
    return DecodeEngine(
        EngineConfig(
            model=str(model_dir),
            parallel=parallel,
            master_port=0,
            kv_budget_mb=2,
            block_size=4,
            kernels=KernelConfig(decode_attention=kernel),
            **kw,  # type: ignore[arg-type]
        )
    )


@pytest.mark.parametrize(
    ("parallel", "kernel"),
    [
        (ParallelConfig(tp=2), "native"),
        (ParallelConfig(tp=2, latent_groups=1, mode=ParallelMode.TPLA), "torch"),
        (ParallelConfig(tp=2, mode=ParallelMode.SP, chunk_size=4), "native"),
    ],
    ids=["mla-tp", "tpla-r1", "sp"],
)
def test_greedy_equals_the_single_process_model(
    model_dir: Path, parallel: ParallelConfig, kernel: str
) -> None:
    prompt = torch.randint(2, 160, (29,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = generate(load_model(model_dir), prompt, GREEDY).token_ids
    with _engine(model_dir, parallel, kernel) as engine:
        assert engine.runtime.index_cache is not None
        # The group's own prefill pass writes no indexer keys: it refuses, and the router
        # sends the prompt to a prefill worker (services/router/prefilling.py).
        engine.reserve("local", len(prompt), GREEDY.max_tokens)
        with pytest.raises(LocalPrefillOff):
            engine.prefill("local", prompt, GREEDY)
        assert engine.abort("local")
        prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
        [(first, stream)] = submit(engine, prefill, [prompt], [GREEDY])
        assert collect(first, stream).token_ids == expected


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_speculation_keeps_the_plain_tokens(tmp_path: Path, method: str) -> None:
    save_hf("glm-shared", tmp_path)
    add_mtp_layer(tmp_path)
    repeat = [7, 8, 9, 10, 11, 12] * 5  # n-gram drafts find something to propose
    prompts = [
        repeat,
        torch.randint(2, 160, (26,), generator=torch.Generator().manual_seed(5)).tolist(),
    ]
    expected = [generate(load_model(tmp_path), p, GREEDY).token_ids for p in prompts]
    spec = SpecConfig(method, tokens=3, max_batch=4)
    with _engine(tmp_path, ParallelConfig(tp=2), "torch", speculative=spec) as engine:
        prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
        layer = load_prefill_mtp(engine.cfg.model, engine.cfg.reparam, prefill)
        started = submit(engine, prefill, prompts, [GREEDY] * 2, layer if method == "mtp" else None)
        assert [collect(*s).token_ids for s in started] == expected


def test_fp8_index_keys_serve(model_dir: Path) -> None:
    """DeepSeek's fp8 keys: the engine runs on them (their fidelity: benchmarks/fidelity.md)."""
    prompt = torch.randint(2, 160, (29,), generator=torch.Generator().manual_seed(2)).tolist()
    with _engine(model_dir, ParallelConfig(tp=2), "torch", index_cache_dtype="fp8") as engine:
        keys = engine.runtime.index_cache
        assert keys is not None and keys.layout.dtype == torch.uint8
        prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
        [(first, stream)] = submit(engine, prefill, [prompt], [GREEDY])
        assert len(collect(first, stream).token_ids) == GREEDY.max_tokens
