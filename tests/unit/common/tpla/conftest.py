"""The tiny model the TPLA tests share, loaded from `tiny_dir` (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.loading.loader import load_model
from common.model.causal_lm import DeepseekForCausalLM


@pytest.fixture()
def tiny_model(tiny_dir: Path) -> DeepseekForCausalLM:
    return load_model(tiny_dir)
