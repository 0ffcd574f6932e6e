"""MTP drafts in the real decode engine (tp = 2 rank groups: TPLA r = 2, MLA-TP, SP; torch
backend), on the demo (its trained MTP layer) and on a tiny random DeepSeek-V3 checkpoint
with an MTP layer: the MTP module's latents come with the prompt's, its first drafts from
the prefill's last hidden state; every request's tokens, greedy and seeded, are those of
the same group without speculation, drafts are fed (and on the demo kept), and a step's
host waits do not change."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.loading.serving_model import load_prefill_model, load_prefill_mtp
from common.sampling.params import SamplingParams
from common.text.tokenizer import Tokenizer
from services.decode.config import EngineConfig, SpecConfig
from services.decode.engine import DecodeEngine
from tests.shard_checkpoints import MTP_CONFIG, mtp_state, random_state, save_checkpoint
from tests.tiny_engines import TINY_LAYOUTS, tiny_engine
from tools.local_driver import collect, submit

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"
MTP = SpecConfig("mtp", tokens=3, max_batch=4)
PLAIN = SpecConfig()
TEXT = (
    "The river ran along the old town wall, and every morning the baker opened his shop "
    "before the sun came up over the hills. The children of the town"
)


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    main = random_state()
    state = {**main, **mtp_state(main, "equal")}
    return save_checkpoint(state, tmp_path_factory.mktemp("mtp-v3"), **MTP_CONFIG)


@pytest.fixture(
    scope="module",
    params=[(m, lay) for m in ("demo", "tiny-v3") for lay in TINY_LAYOUTS],
    ids=lambda p: "-".join(p),
)
def engine(request: pytest.FixtureRequest, tiny_v3: Path):
    which, layout = request.param
    model = DEMO if which == "demo" else tiny_v3
    parallel = TINY_LAYOUTS[layout]
    with tiny_engine(model, parallel, (1,), kv_budget_mb=4, max_batch=16, speculative=MTP) as eng:
        yield eng


def _prompts(engine: DecodeEngine) -> list[list[int]]:
    if Path(engine.cfg.model) == DEMO:
        ids = Tokenizer.from_dir(engine.cfg.model).encode(TEXT, add_bos=False)
        return [ids, ids[:17]]
    return [[5, 200, 31, 77, 90, 12, 45, 100, 3, 17, 250], list(range(40, 60))]


def _run(engine: DecodeEngine, spec: SpecConfig, prompts, params) -> list[list[int]]:
    engine.speculate(spec)
    prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
    mtp = load_prefill_mtp(engine.cfg.model, engine.cfg.reparam, prefill)
    results = [collect(*s) for s in submit(engine, prefill, prompts, params, mtp)]
    load = engine.load()
    assert (load.running, load.reserved, load.blocks_used) == (0, 0, 0)
    return [[*r.token_ids, r.finish_reason] for r in results]


def test_mtp_drafts_change_no_token(engine: DecodeEngine) -> None:
    """Greedy and seeded, together and alone: the same tokens with and without drafts."""
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=18, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
    ]
    prompts = _prompts(engine)
    plain = _run(engine, PLAIN, prompts, params)
    before = engine.probe.acceptance.drafted, engine.probe.acceptance.accepted
    assert _run(engine, MTP, prompts, params) == plain
    for p, prompt, expected in zip(params, prompts, plain, strict=True):
        assert _run(engine, MTP, [prompt], [p]) == [expected]
    drafted = engine.probe.acceptance.drafted - before[0]
    accepted = engine.probe.acceptance.accepted - before[1]
    assert drafted > 0
    if Path(engine.cfg.model) == DEMO:
        assert accepted > 0  # the trained layer's drafts are kept


def test_an_mtp_step_adds_no_host_wait(engine: DecodeEngine) -> None:
    """Every rank's host waits per step, the draft pass included: the same as without."""
    if not engine.cfg.parallel.caches_every_token or Path(engine.cfg.model) != DEMO:
        pytest.skip("one layout and model is enough")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    counts: list[int] = []
    engine.probe.on_step = lambda _s, _b: counts.append(engine.probe.last_host_syncs)
    engine.probe.count_syncs = True
    try:
        prompt = _prompts(engine)[:1]
        _run(engine, PLAIN, prompt, [greedy])
        plain, counts[:] = set(counts), []
        before = engine.probe.acceptance.drafted
        _run(engine, MTP, prompt, [greedy])
        assert engine.probe.acceptance.drafted > before
    finally:
        engine.probe.count_syncs = False
        engine.probe.on_step = None
    assert set(counts) == plain and max(plain) <= 2


def test_mtp_is_refused_on_a_group_started_without_it(tiny_v3: Path) -> None:
    cfg = EngineConfig(model=str(tiny_v3), master_port=0, kv_budget_mb=2, block_size=4)
    with (
        DecodeEngine(cfg, eos_token_ids=(1,)) as eng,
        pytest.raises(ValueError, match="TPLA_SPECULATIVE=mtp"),
    ):
        eng.speculate(MTP)
