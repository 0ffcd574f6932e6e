"""Model directories for the text tests: a trained tokenizer.json and the config files beside it,
and texts whose characters span 1-4 UTF-8 bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers

from tests.tiny import TEMPLATE

# Mixed-script texts whose characters span 1-4 UTF-8 bytes.
UNICODE_TEXTS = [
    "hello world",
    "héllo wörld 你好 🙂",
    "🚀🎉🙂 东京 naïve",
    "a🦀b 𝄞 z",  # 🦀 and 𝄞 are not in the corpus, so they split into byte tokens
    "",
]


def write_model_dir(
    directory: Path,
    backend: tokenizers.Tokenizer,
    config: dict[str, Any] | None = None,
    generation: dict[str, Any] | None = None,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation), encoding="utf-8")
    return directory


def default_config(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "chat_template": TEMPLATE,
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "add_bos_token": True,
    }
    config.update(overrides)
    return config
