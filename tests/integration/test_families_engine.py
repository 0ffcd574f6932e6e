"""Every family of the registry through the decode engine's layouts as real multi-process
groups (tp = 2): MLA-TP and SP exact (each step's logits equal the single-process MLA
oracle's, greedy tokens equal), TPLA asked with r = 1 is MLA-TP, and TPLA r = 2 runs its
approximation (each step's logits equal the TPLA oracle's).

Every family goes through a layout that shards its heads, experts and vocabulary (MLA-TP, or
SP, which shards heads alike). The layout code is shared by the families, so SP and TPLA r = 2
run for the families whose differences reach what those layouts split: Mistral Small 4 (a
query scaled by each position, which SP spreads over ranks; kv_lora 256, which TPLA splits)
and GLM-4.7-Flash (nope 192 / v 256 over TPLA's latent columns). The V3-shaped rest (Kimi,
Sarvam, A.X-K1, Youtu) differ in the MoE, norms, rope and embedding, which MLA-TP runs as the
other layouts do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.loading.loader import load_model
from common.loading.serving_model import load_prefill_model
from common.model.generate import generate
from common.parallel import ParallelConfig, ParallelError, ParallelMode
from common.sampling.params import SamplingParams
from common.tpla.reference import AttentionSpec, ReferenceModel, Variant
from services.decode.config import EngineConfig
from services.decode.engine import DecodeEngine
from tests.tiny_families import FAMILY_VARIANTS, save_family
from tools.local_driver import collect, submit

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LAYOUTS = {
    "mla-tp": (ParallelConfig(tp=2, latent_groups=1), AttentionSpec(Variant.MLA)),
    "sp": (
        ParallelConfig(tp=2, mode=ParallelMode.SP, chunk_size=4),
        AttentionSpec(Variant.MLA),
    ),
    "tpla-r2": (ParallelConfig(tp=2, latent_groups=2), AttentionSpec(Variant.TPLA_PD, groups=2)),
}


# family -> the layouts it runs through (see above). Kimi K2's text model is K2.5's
# (`kimi-k25`, here in its wrapper); Mistral's SP shards its heads as MLA-TP does.
RUNS = {
    **{family: ("mla-tp",) for family in FAMILY_VARIANTS if family != "kimi-k2"},
    "glm4-moe-lite": ("mla-tp", "tpla-r2"),
    "mistral4": ("sp", "tpla-r2"),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's tiny checkpoint, written once for all its layouts."""
    return {}


def _model_dir(dirs: dict[str, Path], family: str, tmp: pytest.TempPathFactory) -> Path:
    if family not in dirs:
        dirs[family] = tmp.mktemp(family)
        save_family(family, dirs[family], std=0.08)
    return dirs[family]


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(
    ("family", "layout"), [(f, lay) for f in sorted(RUNS) for lay in RUNS[f]], ids=str
)
def test_each_layout_equals_its_oracle(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, family: str, layout: str
) -> None:
    model_dir = _model_dir(model_dirs, family, tmp_path_factory)
    parallel, spec = LAYOUTS[layout]
    prompt = _prompt(13, 1)
    cfg = EngineConfig(
        model=str(model_dir),
        parallel=parallel,
        master_port=0,
        kv_budget_mb=2,
        block_size=4,
        record_logits=True,
    )
    with DecodeEngine(cfg) as engine:
        prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
        [(first, stream)] = submit(engine, prefill, [prompt], [GREEDY])
        result = collect(first, stream)
    model = load_model(model_dir)
    oracle = ReferenceModel(model, spec)
    state = oracle.start()
    oracle.prefill(state, torch.tensor(prompt))
    for token, event in zip(result.token_ids[:-1], result.events, strict=True):
        torch.testing.assert_close(event.logits, oracle.decode(state, token), atol=1e-5, rtol=0)
    if spec.variant is Variant.MLA:
        assert result.token_ids == generate(model, prompt, GREEDY).token_ids


def test_tpla_asked_with_r1_is_mla_tp() -> None:
    assert ParallelConfig(tp=2, latent_groups=1) == ParallelConfig(tp=2, mode=ParallelMode.MLA_TP)


def test_heads_that_do_not_split_are_named(tmp_path: Path) -> None:
    """GLM-4.7-Flash's 20 heads (10 in the tiny one) split over tp = 2, not over 4."""
    save_family("glm4-moe-lite", tmp_path)
    config = load_model(tmp_path).config
    ParallelConfig(tp=2).check(config)
    with pytest.raises(ParallelError, match=r"num_attention_heads \(10\) is not divisible by 4"):
        ParallelConfig(tp=4).check(config)
