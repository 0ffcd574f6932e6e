"""common.text.tiktoken_vocabulary on a tiny tiktoken BPE built here (the 256 bytes and a few
merges), laid out as Kimi K2's tokenizer files are: tiktoken.model, a tokenizer_config.json
naming tokenization_kimi.py with its added tokens, and that .py file, which must never run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.runtime.errors import TokenizerError
from common.text.chat_template import ChatMessage
from common.text.tiktoken_vocabulary import (
    KIMI_RESERVED_SPECIALS,
    TiktokenVocabulary,
    read_ranks,
    split_pattern,
)
from common.text.tokenizer import Tokenizer
from tests.tiny_families import KIMI_BASE, KIMI_MERGES, save_kimi_tokenizer


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_kimi_tokenizer(tmp_path_factory.mktemp("kimi-tok"))


@pytest.fixture(scope="module")
def vocab(kimi_dir: Path) -> TiktokenVocabulary:
    config = json.loads((kimi_dir / "tokenizer_config.json").read_text())
    return TiktokenVocabulary.from_dir(kimi_dir, config, None)


def test_ranks_and_specials_as_kimis_code_numbers_them(vocab: TiktokenVocabulary) -> None:
    assert vocab.size == KIMI_BASE + KIMI_RESERVED_SPECIALS + 2
    assert (
        vocab.token_to_id("[BOS]") == KIMI_BASE and vocab.token_to_id("<|im_end|>") == KIMI_BASE + 2
    )
    last = KIMI_BASE + KIMI_RESERVED_SPECIALS + 1
    assert vocab.token_to_id(f"<|reserved_token_{last}|>") == last
    assert vocab.token_to_id("hello") == 256 + KIMI_MERGES.index(b"hello")
    assert vocab.token_to_id("nope") is None


def test_the_split_pattern_is_kimis(vocab: TiktokenVocabulary) -> None:
    rank = {t: 256 + k for k, t in enumerate(KIMI_MERGES)}
    # Digits go in threes: 1234 is never one token although the BPE has it.
    assert vocab.encode("1234") == [rank[b"123"], ord("4")]
    # A word keeps its contraction.
    assert vocab.encode("it's") == [rank[b"it's"]]
    assert vocab.encode("hello hello") == [rank[b"hello"], ord(" "), rank[b"hello"]]
    # Han runs split from the letters after them.
    assert vocab.encode("你hello") == [*"你".encode(), rank[b"hello"]]


@pytest.mark.parametrize("text", ["hello world", "héllo 你好 🙂", "a🦀b\n\n  x", ""])
def test_roundtrip(vocab: TiktokenVocabulary, text: str) -> None:
    assert vocab.decode(vocab.encode(text), skip_special_tokens=True) == text


def test_special_strings_encode_to_their_ids_and_skip_on_decode(
    vocab: TiktokenVocabulary,
) -> None:
    ids = vocab.encode("<|im_user|>hello<|im_end|>")
    assert ids == [KIMI_BASE + 3, 256 + KIMI_MERGES.index(b"hello"), KIMI_BASE + 2]
    assert vocab.decode(ids, skip_special_tokens=False) == "<|im_user|>hello<|im_end|>"
    assert vocab.decode(ids, skip_special_tokens=True) == "hello"
    assert vocab.decode([*ids, vocab.size + 5], skip_special_tokens=True) == "hello"
    with pytest.raises(TokenizerError):
        vocab.decode([-1], skip_special_tokens=True)


def test_a_kimi_directory_serves_its_template_without_running_its_code(kimi_dir: Path) -> None:
    tok = Tokenizer.from_dir(kimi_dir)
    assert tok.bos_token_id == KIMI_BASE and tok.eos_token_ids == frozenset({KIMI_BASE + 2})
    ids = tok.encode_chat([ChatMessage("user", "hello")])
    assert ids[:3] == [KIMI_BASE + 3, *tok.encode("user")][:3]
    assert tok.decode(ids, skip_special_tokens=False) == (
        "<|im_user|>user<|im_middle|>hello<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )


def test_unknown_tokenizer_code_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="unknown code"):
        split_pattern({"auto_map": {"AutoTokenizer": ["tokenization_other.T", None]}}, "llama")
    assert split_pattern({}, "kimi_k25") == split_pattern({}, "kimi_k2")
    (tmp_path / "tiktoken.model").write_text("not-base64 x\n")
    with pytest.raises(TokenizerError, match=r"tiktoken\.model:1"):
        read_ranks(tmp_path / "tiktoken.model")
