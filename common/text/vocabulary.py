"""What `Tokenizer` asks of a model's vocabulary (encode, decode, special-token ids), and its
HuggingFace `tokenizers` form, read from tokenizer.json. The other form is a tiktoken model's
(tiktoken_vocabulary.py: Kimi K2's)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import tokenizers

from common.runtime.errors import TokenizerError


class Vocabulary(Protocol):
    """A model's token vocabulary: text to ids and back."""

    @property
    def size(self) -> int:
        """Number of token ids, special tokens included."""
        ...

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, special-token strings in it as their ids; no BOS added."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...


class HfVocabulary:
    """A HuggingFace `tokenizers` tokenizer (tokenizer.json)."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        # Some tokenizer.json files ship truncation/padding settings meant for training; in
        # serving they would silently cut or pad prompts.
        backend.no_truncation()
        backend.no_padding()
        self.backend = backend

    @classmethod
    def from_file(cls, path: Path) -> HfVocabulary:
        try:
            return cls(tokenizers.Tokenizer.from_file(str(path)))
        except Exception as exc:  # the Rust binding raises bare Exception on parse errors
            raise TokenizerError(f"cannot load {path}: {exc}") from exc

    @property
    def size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # The backend's post-processor may add its own specials; Tokenizer manages BOS.
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)
