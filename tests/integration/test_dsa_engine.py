"""DeepSeek Sparse Attention in the decode engine (real multi-process groups on loopback): a
prompt past index_topk decodes the single-process model's greedy tokens in MLA-TP and in SP,
on the native and torch backends (dense steps on the backend's kernel, sparse ones on the
gathered rows), and TPLA with one latent group is MLA-TP."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.loading.loader import load_model
from common.loading.serving_model import load_prefill_model
from common.model.generate import generate
from common.parallel import ParallelConfig, ParallelMode
from common.runtime.kernel_choice import KernelConfig
from common.sampling.params import SamplingParams
from services.decode.config import EngineConfig
from services.decode.engine import DecodeEngine
from tests.tiny import save_hf
from tools.local_driver import collect, submit

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["v32-sparse", "glm-shared"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    save_hf(request.param, path)
    return path


def _engine(model_dir: Path, parallel: ParallelConfig, kernel: str) -> DecodeEngine:
    return DecodeEngine(
        EngineConfig(
            model=str(model_dir),
            parallel=parallel,
            master_port=0,
            kv_budget_mb=2,
            block_size=4,
            kernels=KernelConfig(decode_attention=kernel),
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
        prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
        [(first, stream)] = submit(engine, prefill, [prompt], [GREEDY])
        assert collect(first, stream).token_ids == expected
