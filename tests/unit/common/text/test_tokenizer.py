"""common.text.tokenizer against a real byte-level BPE tokenizer trained in-process: loading a
model directory (and its errors), encode and decode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tokenizers

from common.runtime.errors import TokenizerError
from common.text.chat_template import ChatMessage
from common.text.tokenizer import Tokenizer
from tests.tiny import TEMPLATE
from tests.unit.common.text.tokenizer_files import UNICODE_TEXTS, default_config, write_model_dir

# --- loading -----------------------------------------------------------------------------


def test_from_dir_reads_config(tok: Tokenizer, backend: tokenizers.Tokenizer) -> None:
    assert tok.vocab_size == backend.get_vocab_size(with_added_tokens=True)
    assert tok.bos_token_id == backend.token_to_id("<|bos|>")
    assert tok.eos_token_ids == frozenset({backend.token_to_id("<|eos|>")})
    assert tok.has_chat_template
    assert tok.add_bos_token


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json in"):
        Tokenizer.from_dir(tmp_path)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")


def test_corrupt_files_name_the_file(tmp_path: Path, backend: tokenizers.Tokenizer) -> None:
    bad = tmp_path / "bad_tok"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(bad)

    model = write_model_dir(tmp_path / "bad_cfg", backend)
    (model / "tokenizer_config.json").write_text("[1, 2", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json"):
        Tokenizer.from_dir(model)


def test_config_is_optional(tmp_path: Path, backend: tokenizers.Tokenizer) -> None:
    t = Tokenizer.from_dir(write_model_dir(tmp_path, backend))
    assert t.bos_token_id is None
    assert t.eos_token_ids == frozenset()
    assert not t.has_chat_template
    assert not t.add_bos_token
    assert t.encode("hello") == backend.encode("hello", add_special_tokens=False).ids


def test_token_dict_forms_accepted(tmp_path: Path, backend: tokenizers.Tokenizer) -> None:
    config = default_config(
        bos_token={"__type": "AddedToken", "content": "<|bos|>", "special": True},
        eos_token={"content": "<|eos|>", "lstrip": False},
    )
    t = Tokenizer.from_dir(write_model_dir(tmp_path, backend, config))
    assert t.bos_token == "<|bos|>"
    assert t.bos_token_id == backend.token_to_id("<|bos|>")
    assert t.eos_token_ids == frozenset({backend.token_to_id("<|eos|>")})
    assert t.apply_chat_template([ChatMessage("user", "hi")]) == (
        "<|bos|><|user|>hi<|eos|><|assistant|>"
    )


def test_bad_special_tokens_rejected(tmp_path: Path, backend: tokenizers.Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="bos_token"):
        Tokenizer.from_dir(write_model_dir(tmp_path / "a", backend, {"bos_token": 3}))
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        Tokenizer.from_dir(write_model_dir(tmp_path / "b", backend, {"eos_token": "<|nope|>"}))


@pytest.mark.parametrize(("eos_field", "extra"), [(2, {2}), ([2, 3], {2, 3})])
def test_generation_config_eos_ids(
    tmp_path: Path, backend: tokenizers.Tokenizer, eos_field: Any, extra: set[int]
) -> None:
    t = Tokenizer.from_dir(
        write_model_dir(tmp_path, backend, default_config(), {"eos_token_id": eos_field})
    )
    assert t.eos_token_ids == frozenset(extra | {backend.token_to_id("<|eos|>")})


def test_generation_config_bad_eos(tmp_path: Path, backend: tokenizers.Tokenizer) -> None:
    with pytest.raises(TokenizerError, match=r"generation_config\.json"):
        Tokenizer.from_dir(
            write_model_dir(tmp_path, backend, default_config(), {"eos_token_id": "x"})
        )


# --- encode / decode ---------------------------------------------------------------------


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_bos=False)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_multibyte_text_uses_merges(tok: Tokenizer) -> None:
    # The corpus makes 你好 frequent, so it must not cost one token per byte.
    assert len(tok.encode("你好", add_bos=False)) < len("你好".encode())


def test_bos_handling(tok: Tokenizer) -> None:
    bos = tok.bos_token_id
    plain = tok.encode("hello world", add_bos=False)
    assert bos not in plain
    assert tok.encode("hello world", add_bos=True) == [bos, *plain]
    assert tok.encode("hello world") == [bos, *plain]  # config add_bos_token=True
    assert tok.decode([bos, *plain]) == "hello world"
    assert tok.decode([bos, *plain], skip_special_tokens=False) == "<|bos|>hello world"


def test_add_bos_without_bos_token(tmp_path: Path, backend: tokenizers.Tokenizer) -> None:
    t = Tokenizer.from_dir(write_model_dir(tmp_path, backend, {"chat_template": TEMPLATE}))
    assert t.encode("hi") == t.encode("hi", add_bos=False)
    with pytest.raises(TokenizerError, match="bos"):
        t.encode("hi", add_bos=True)


def test_decode_negative_id(tok: Tokenizer) -> None:
    with pytest.raises(TokenizerError):
        tok.decode([-1])
