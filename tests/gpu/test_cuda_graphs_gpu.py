"""The decode step as CUDA graphs (services/decode/rank/graphs.py): every bucket captured at
start-up, replays that give the eager step's tokens, and no capture while serving."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.loading.serving_model import load_prefill_model
from common.parallel import ParallelConfig
from common.sampling.params import SamplingParams
from services.decode.config import EngineConfig
from services.decode.engine import DecodeEngine
from tools.cli.local import collect, submit

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


def _engine(graphs: bool, kernel: str) -> DecodeEngine:
    cfg = EngineConfig(
        model=str(DEMO),
        parallel=ParallelConfig(tp=1, latent_groups=1),
        master_port=0,
        kv_budget_mb=16,
        block_size=16,
        max_batch=8,
        max_model_len=512,
        dtype="float32",
        device="cuda",
        decode_kernel=kernel,
        cuda_graphs=graphs,
    )
    return DecodeEngine(cfg)


def _decode(engine: DecodeEngine) -> list[list[int]]:
    """Five prompts of different lengths decoded side by side (batch buckets 1 to 8 as they
    join and leave, several table widths), greedy."""
    g = torch.Generator().manual_seed(0)
    vocab = engine.runtime.model.config.vocab_size
    prompts = [torch.randint(2, vocab, (5 + 23 * i,), generator=g).tolist() for i in range(5)]
    prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
    params = [
        SamplingParams(max_tokens=20 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(5)
    ]
    return [
        collect(first, stream).token_ids
        for first, stream in submit(engine, prefill, prompts, params)
    ]


@pytest.mark.parametrize("kernel", ["triton", "torch"])
def test_graph_replays_give_the_eager_steps_tokens(kernel: str) -> None:
    with _engine(False, kernel) as engine:
        assert engine.runtime.graphs is None
        eager = _decode(engine)
    with _engine(True, kernel) as engine:
        graphs = engine.runtime.graphs
        assert graphs is not None
        captured = len(graphs)
        assert captured == len(engine.buckets), "every bucket is captured at start-up"
        replayed = _decode(engine)
        assert len(graphs) == captured, "nothing is captured while serving"
    assert replayed == eager
