"""The decode engine's config: the MoE mode travels from the settings to every rank."""

from __future__ import annotations

import pytest

from common.parallel import MoeParallel
from common.runtime.settings import load_settings
from services.decode.config import EngineConfig, engine_config


@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_moe_parallel_reaches_the_ranks_config(moe: str) -> None:
    cfg = engine_config(load_settings(moe_parallel=moe))
    assert cfg.parallel.moe is MoeParallel(moe)
    assert EngineConfig.from_json(cfg.to_json()) == cfg  # what a spawned rank reads


def test_an_unknown_moe_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="not tp or ep"):
        engine_config(load_settings(moe_parallel="dp"))
