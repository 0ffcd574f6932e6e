"""A tiktoken model's vocabulary (Kimi K2's `tiktoken.model`), read without running the
checkpoint's Python.

Kimi ships its tokenizer as code (tokenization_kimi.py, loaded with trust_remote_code): a
tiktoken BPE whose ranks are `tiktoken.model` (one `base64(token bytes) rank` a line), its
pre-tokenizer split pattern written in that code, and its special tokens the ids after the
ranks: num_reserved_special_tokens + 2 of them, each named by tokenizer_config.json's
`added_tokens_decoder` or `<|reserved_token_{id}|>`. The pattern and that rule are here, keyed
by the module the checkpoint's `auto_map` names (or the config's model_type), so serving Kimi
never executes a file from the model directory. Special-token strings in a text encode to
their ids (Kimi's `allow_special_tokens`); skipping special tokens in decode drops those ids.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tiktoken

from common.runtime.errors import TokenizerError

TIKTOKEN_FILE = "tiktoken.model"

# tokenization_kimi.py's TikTokenTokenizer.pat_str: runs of Han characters apart; words with a
# leading non-letter and English contractions; digits in threes; punctuation runs; newlines;
# spaces (`&&[^\p{Han}]` is a class intersection, which tiktoken's regex engine reads).
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
KIMI_RESERVED_SPECIALS = 256  # tokenization_kimi.py's num_reserved_special_tokens

# The tokenizer code a checkpoint names (auto_map's AutoTokenizer module), or its config.json
# model_type, -> the split pattern that code uses.
_PATTERNS_BY_CODE = {"tokenization_kimi": KIMI_PATTERN}
_PATTERNS_BY_MODEL_TYPE = {"kimi_k2": KIMI_PATTERN, "kimi_k25": KIMI_PATTERN}


def read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken BPE file's token bytes -> rank."""
    ranks: dict[bytes, int] = {}
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as exc:
            raise TokenizerError(f"{path}:{n}: not a `base64 rank` line: {exc}") from exc
    return ranks


def split_pattern(tokenizer_config: Mapping[str, Any], model_type: str | None) -> str:
    """The split pattern of the tokenizer code a checkpoint names; TokenizerError for code
    this server does not know."""
    auto_map = tokenizer_config.get("auto_map") or {}
    names = auto_map.get("AutoTokenizer") or []
    for name in [names] if isinstance(names, str) else names:
        module = str(name or "").split(".")[0]
        if module in _PATTERNS_BY_CODE:
            return _PATTERNS_BY_CODE[module]
    if model_type in _PATTERNS_BY_MODEL_TYPE:
        return _PATTERNS_BY_MODEL_TYPE[model_type]
    raise TokenizerError(
        f"a {TIKTOKEN_FILE} tokenizer of unknown code ({names or 'no auto_map'}, model_type "
        f"{model_type!r}): its split pattern is known for {sorted(_PATTERNS_BY_CODE)}"
    )


class TiktokenVocabulary:
    """A tiktoken BPE plus its special tokens (the `Vocabulary` of tokenizer.py)."""

    def __init__(self, ranks: dict[bytes, int], pattern: str, specials: dict[str, int]) -> None:
        self.encoding = tiktoken.Encoding(
            name="model", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
        )
        self._specials = dict(specials)
        self._special_ids = frozenset(specials.values())
        self._ranks = ranks

    @classmethod
    def from_dir(
        cls, directory: Path, tokenizer_config: Mapping[str, Any], model_type: str | None
    ) -> TiktokenVocabulary:
        """`directory`'s tiktoken.model with the specials and pattern Kimi's code gives it."""
        ranks = read_ranks(directory / TIKTOKEN_FILE)
        pattern = split_pattern(tokenizer_config, model_type)
        named: dict[int, str] = {}
        for key, token in (tokenizer_config.get("added_tokens_decoder") or {}).items():
            content = token.get("content") if isinstance(token, Mapping) else None
            if not isinstance(content, str):
                raise TokenizerError(f"added_tokens_decoder[{key!r}] has no string content")
            named[int(key)] = content
        first = len(ranks)
        specials = {
            named.get(i, f"<|reserved_token_{i}|>"): i
            for i in range(first, first + KIMI_RESERVED_SPECIALS + 2)
        }
        return cls(ranks, pattern, specials)

    @property
    def size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        if any(i < 0 for i in ids):
            raise TokenizerError(f"invalid token id in {list(ids)!r}")
        # Ids past the vocabulary (a padded embedding's) are dropped, as `tokenizers` does.
        kept = [i for i in ids if i < self.size]
        if skip_special_tokens:
            kept = [i for i in kept if i not in self._special_ids]
        return self.encoding.decode(kept, errors="replace")

    def token_to_id(self, token: str) -> int | None:
        if token in self._specials:
            return self._specials[token]
        return self._ranks.get(token.encode("utf-8"))
