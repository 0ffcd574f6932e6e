"""The trained byte-level BPE tokenizers the text tests share (tests/tiny.py trains them)."""

from __future__ import annotations

import pytest
import tokenizers

from common.text.tokenizer import Tokenizer
from tests.tiny import CORPUS, SPECIAL_TOKENS, train_tokenizer
from tests.unit.common.text.tokenizer_files import default_config, write_model_dir


@pytest.fixture(scope="module")
def backend() -> tokenizers.Tokenizer:
    return train_tokenizer(400, CORPUS)


@pytest.fixture(scope="module")
def bytes_backend() -> tokenizers.Tokenizer:
    # vocab = specials + the 256 byte symbols: no merges, so every byte is its own token.
    return train_tokenizer(len(SPECIAL_TOKENS) + 256, ["x"])


@pytest.fixture(scope="module")
def tok(backend: tokenizers.Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    # Module-scoped so hypothesis tests can use it (function-scoped fixtures are not reset
    # between examples).
    return Tokenizer.from_dir(
        write_model_dir(tmp_path_factory.mktemp("model"), backend, default_config())
    )


@pytest.fixture(scope="module")
def bytes_tok(
    bytes_backend: tokenizers.Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> Tokenizer:
    return Tokenizer.from_dir(
        write_model_dir(tmp_path_factory.mktemp("bytes"), bytes_backend, default_config())
    )
