"""An FP8 checkpoint served with its weights kept FP8 (TPLA_WEIGHT_DTYPE=float8) answers greedy
requests exactly as with the weights dequantized at load: real multi-process decode groups,
for tp 1, TPLA tp 2 r 2, MLA-TP and SP, with blocks of 40 (partial edge blocks, rank slices
starting inside blocks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.loading.serving_model import load_prefill_model
from common.model.fp8 import Fp8Weight
from common.parallel import ParallelConfig, ParallelMode
from common.sampling.params import SamplingParams
from services.decode.config import EngineConfig
from services.decode.engine import DecodeEngine
from tests.shard_checkpoints import fp8_copy
from tests.tiny import save_hf
from tools.local_driver import collect, submit

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LAYOUTS = {
    "tp1": ParallelConfig(),
    "tpla-tp2-r2": ParallelConfig(tp=2, latent_groups=2),
    "mla-tp-tp2": ParallelConfig(tp=2, latent_groups=1),
    "sp-tp2": ParallelConfig(tp=2, mode=ParallelMode.SP, chunk_size=4),
}


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fp8-engine")
    save_hf("v3-noaux-yarn", root / "hf", std=0.08)
    return fp8_copy(root / "hf", root, block=40)[0]


def _answers(model_dir: Path, parallel: ParallelConfig, weight_dtype: str) -> list[list[int]]:
    cfg = EngineConfig(
        model=str(model_dir),
        parallel=parallel,
        master_port=0,
        kv_budget_mb=2,
        block_size=4,
        weight_dtype=weight_dtype,
    )
    prompts = [
        torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (9, 23)
    ]
    prefill = load_prefill_model(model_dir, None, weight_dtype=weight_dtype)
    with DecodeEngine(cfg) as engine:
        kept = any(isinstance(m, Fp8Weight) for m in engine.runtime.model.modules())
        assert kept == (weight_dtype == "float8")
        streams = submit(engine, prefill, prompts, [GREEDY] * len(prompts))
        return [collect(first, stream).token_ids for first, stream in streams]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_resident_greedy_equals_dequantized(fp8_dir: Path, layout: str) -> None:
    resident = _answers(fp8_dir, LAYOUTS[layout], "float8")
    assert resident == _answers(fp8_dir, LAYOUTS[layout], "dequantize")
    assert all(len(t) == GREEDY.max_tokens for t in resident)
