"""The e2e stack: `tpla serve` (tests/stack.py) on a tiny chat model, one per module.

Its prefill workers prefill in chunks of 7 tokens (KV blocks of 16), every chunk shipped as
it is computed: the tests' answers are held to `tpla generate`, which prefills whole, so
every e2e test also holds chunked prefill to the unchunked answers."""

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
    s = start_stack(tiny_model, "grpc", PREFILL_CHUNK_TOKENS="7")
    yield s
    s.stop()
