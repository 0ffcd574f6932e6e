"""The tiny checkpoint the TPLA tests share (tests/tiny.py builds it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.loading.loader import load_model
from common.model.model import DeepseekForCausalLM
from tests.tiny import save_tiny_chat_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V2 checkpoint with a tokenizer (d_c = 32, 4 heads, 3 layers)."""
    return save_tiny_chat_model(tmp_path_factory.mktemp("tpla-tiny"), std=0.05)


@pytest.fixture()
def tiny_model(tiny_dir: Path) -> DeepseekForCausalLM:
    return load_model(tiny_dir)
