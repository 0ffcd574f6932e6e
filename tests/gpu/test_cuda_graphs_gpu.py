"""The decode step as CUDA graphs (services/decode/rank/graphs.py): every bucket captured at
start-up, replays that give the eager step's tokens, and no capture while serving."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.loading.serving_model import load_prefill_model
from common.parallel import ParallelConfig
from common.runtime.kernel_choice import KernelConfig
from common.sampling.params import SamplingParams
from services.decode.config import EngineConfig
from services.decode.engine import DecodeEngine
from tests.tiny import save_hf
from tools.local_driver import collect, submit

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model without MoE layers: its fp32 step is all capturable (fp32 experts run
    the per-expert loop on CUDA, which reads counts to the host)."""
    out = tmp_path_factory.mktemp("dense")
    save_hf("v2-greedy", out, first_k_dense_replace=3)
    return out


def _engine(model: Path, graphs: bool, kernel: str, dtype: str = "float32") -> DecodeEngine:
    cfg = EngineConfig(
        model=str(model),
        parallel=ParallelConfig(tp=1, latent_groups=1),
        master_port=0,
        kv_budget_mb=16,
        block_size=16,
        max_batch=8,
        max_model_len=512,
        dtype=dtype,
        device="cuda",
        kernels=KernelConfig(decode_attention=kernel),
        cuda_graphs=graphs,
        record_logits=True,
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
    streams = submit(engine, prefill, prompts, params)
    return [collect(first, stream).token_ids for first, stream in streams]


@pytest.mark.parametrize("kernel", ["triton", "torch"])
def test_graph_replays_give_the_eager_steps_tokens(dense_model: Path, kernel: str) -> None:
    with _engine(dense_model, False, kernel) as engine:
        assert engine.runtime.graphs is None
        eager = _decode(engine)
    with _engine(dense_model, True, kernel) as engine:
        graphs = engine.runtime.graphs
        assert graphs is not None
        captured = len(graphs)
        assert captured == len(engine.shapes), "every shape is captured at start-up"
        replayed = _decode(engine)
        assert len(graphs) == captured, "nothing is captured while serving"
    assert replayed == eager


def _first_step_logits(engine: DecodeEngine) -> torch.Tensor:
    vocab = engine.runtime.model.config.vocab_size
    prompt = torch.randint(2, vocab, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    [(first, stream)] = submit(engine, prefill, [prompt], [params])
    logits = collect(first, stream).events[0].logits
    assert logits is not None
    return logits.float()


def test_a_bf16_moe_step_is_captured_and_replays_the_eager_logits() -> None:
    """bf16 experts run one grouped GEMM, which a graph can hold: the demo model's step is
    captured, and its replay computes what the eager step does."""
    with _engine(DEMO, False, "triton", "bfloat16") as engine:
        eager = _first_step_logits(engine)
    with _engine(DEMO, True, "triton", "bfloat16") as engine:
        assert engine.runtime.graphs is not None and len(engine.runtime.graphs) > 0
        replayed = _first_step_logits(engine)
    assert torch.allclose(replayed, eager, atol=2e-2 * float(eager.abs().max()))
