"""Every step kind has what a CUDA graph capture needs, shown on the CPU, where nothing is
captured: with its plans padded to their shapes as on CUDA, a plain step, an n-gram verify
step and an MTP draft-and-verify step each read inputs of the same shapes for every plan of
a shape, every shape is one the start-up warm-up captures, and the function a graph records
(`RankRuntime.decode`) waits for the host 0 times; the tokens are those of unpadded steps.
The demo model (MoE, with its MTP layer), a tp = 2 TPLA group, greedy and seeded requests."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from common.loading.serving_model import load_prefill_model, load_prefill_mtp
from common.parallel import ParallelConfig
from common.runtime.host_syncs import HostSyncCounter
from common.sampling.params import SamplingParams
from common.text.tokenizer import Tokenizer
from services.decode.config import EngineConfig, SpecConfig
from services.decode.engine import DecodeEngine
from services.decode.rank.graphs import graph_inputs
from services.decode.step_plan import DecodePlan
from tools.local_driver import collect, submit

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"
SPECS = {
    "plain": SpecConfig(),
    "ngram": SpecConfig("ngram", tokens=3, max_batch=4),
    "mtp": SpecConfig("mtp", tokens=2, max_batch=4),
}
TEXT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"
PARAMS = [
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
]


@pytest.fixture(scope="module")
def engine():
    cfg = EngineConfig(
        model=str(DEMO),
        parallel=ParallelConfig(tp=2, latent_groups=2),
        master_port=0,
        kv_budget_mb=4,
        block_size=4,
        max_batch=8,
        max_model_len=256,
        speculative=SPECS["mtp"],  # the ranks hold the MTP module
    )
    with DecodeEngine(cfg, eos_token_ids=(1,)) as eng:
        yield eng


def _run(engine: DecodeEngine, spec: SpecConfig) -> list[list[int]]:
    engine.speculate(spec)
    prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
    mtp = load_prefill_mtp(engine.cfg.model, engine.cfg.reparam, prefill)
    ids = Tokenizer.from_dir(engine.cfg.model).encode(TEXT, add_bos=False)
    return [collect(*s).token_ids for s in submit(engine, prefill, [ids, ids[:9]], PARAMS, mtp)]


@pytest.mark.parametrize("kind", list(SPECS))
def test_every_step_kind_has_static_shapes_and_waits_for_nothing(
    engine: DecodeEngine, kind: str
) -> None:
    spec = SPECS[kind]
    unpadded = _run(engine, spec)
    runtime, plans = engine.runtime, engine._step.plans
    inputs: dict[tuple[int, int, int], set[tuple[tuple[int, ...], ...]]] = defaultdict(set)
    syncs: list[int] = []
    decode = runtime.decode

    def recorded(plan: DecodePlan):  # type: ignore[no-untyped-def]
        inputs[plan.shape].add(tuple(tuple(t.shape) for t in graph_inputs(plan)))
        with HostSyncCounter() as counter:
            out = decode(plan)
        syncs.append(counter.count)
        return out

    drafted = engine.probe.acceptance.drafted
    runtime.decode, plans.bucketed = recorded, True  # padded as the CUDA ranks' plans are
    try:
        padded = _run(engine, spec)
    finally:
        runtime.decode, plans.bucketed = decode, False
    assert padded == unpadded
    assert syncs and max(syncs) == 0
    assert all(len(shapes) == 1 for shapes in inputs.values()), inputs
    captured = {(s.batch, s.width, spec.tokens - 1 if s.drafts else -1) for s in engine.shapes}
    assert set(inputs) <= captured
    chains = {chain for _, _, chain in inputs}
    if kind == "mtp":
        assert spec.tokens - 1 in chains  # steps with a draft pass ran
    if kind != "plain":
        assert engine.probe.acceptance.drafted > drafted
