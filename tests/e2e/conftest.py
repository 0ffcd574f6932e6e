"""The e2e stack: `tpla serve` (tests/stack.py) on a tiny chat model, one per module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.stack import start_stack
from tests.tiny import save_tiny_chat_model
from tools.local_stack import LocalStack


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("e2e-model"), std=0.08)


@pytest.fixture(scope="module")
def stack(tiny_model: Path) -> Iterator[LocalStack]:
    s = start_stack(tiny_model, "grpc")
    yield s
    s.stop()
