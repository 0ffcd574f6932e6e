"""The decode engine's config: the MoE mode and speculation travel from the settings."""

from __future__ import annotations

import pytest

from common.parallel import MoeParallel
from common.runtime.settings import load_settings
from services.decode.config import EngineConfig, SpecConfig, engine_config


@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_moe_parallel_reaches_the_ranks_config(moe: str) -> None:
    cfg = engine_config(load_settings(moe_parallel=moe))
    assert cfg.parallel.moe is MoeParallel(moe)
    assert EngineConfig.from_json(cfg.to_json()) == cfg  # what a spawned rank reads


def test_an_unknown_moe_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="not tp or ep"):
        engine_config(load_settings(moe_parallel="dp"))


def test_speculation_settings_reach_the_config() -> None:
    cfg = engine_config(load_settings(speculative="ngram", spec_tokens=3, spec_max_batch=2))
    assert cfg.speculative == SpecConfig("ngram", tokens=3, max_batch=2)
    assert EngineConfig.from_json(cfg.to_json()) == cfg
    # Unset, k is the proposer's own default.
    for method, k in (("ngram", 4), ("mtp", 1)):
        assert engine_config(load_settings(speculative=method)).speculative.tokens == k
    with pytest.raises(ValueError, match="not one of none, ngram, mtp"):
        engine_config(load_settings(speculative="medusa"))
