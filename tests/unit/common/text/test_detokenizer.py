"""common.text.detokenizer: incremental detokenization never emits a partial character, holds
split characters back until they complete, and costs a window, not the whole text."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import tokenizers
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from common.text.chat_template import ChatMessage
from common.text.detokenizer import IncrementalDetokenizer
from common.text.tokenizer import Tokenizer
from tests.tiny import CORPUS
from tests.unit.common.text.tokenizer_files import UNICODE_TEXTS, default_config, write_model_dir


def _stream(
    tokenizer: Tokenizer,
    ids: Sequence[int],
    prompt_ids: Sequence[int] = (),
    *,
    skip_special_tokens: bool = True,
) -> tuple[list[str], str, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    pushed = [detok.push(i) for i in ids]
    return pushed, detok.flush(), detok


@pytest.mark.parametrize("text", UNICODE_TEXTS)
@pytest.mark.parametrize("which", ["tok", "bytes_tok"])
def test_stream_never_emits_partial_chars(
    request: pytest.FixtureRequest, which: str, text: str
) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(which)
    ids = tokenizer.encode(text, add_bos=False)
    pushed, tail, detok = _stream(tokenizer, ids)
    assert not any("\ufffd" in p for p in pushed)
    assert "".join(pushed) + tail == tokenizer.decode(ids) == text
    assert tail == ""  # valid text is fully emitted by push()
    assert detok.text == text


def test_split_emoji_held_back_until_complete(bytes_tok: Tokenizer) -> None:
    # With no merges, the 4-byte 🦀 is encoded as 4 single-byte tokens.
    ids = bytes_tok.encode("a🦀b", add_bos=False)
    assert len(ids) == 6
    pushed, tail, _ = _stream(bytes_tok, ids)
    assert pushed == ["a", "", "", "", "🦀", "b"]
    assert tail == ""


def test_split_emoji_in_trained_tokenizer(tok: Tokenizer) -> None:
    # 🦀 is absent from the training corpus, so byte-level BPE cannot encode it as one token.
    ids = tok.encode("🦀", add_bos=False)
    assert len(ids) > 1
    pushed, tail, _ = _stream(tok, ids)
    assert pushed[:-1] == [""] * (len(ids) - 1)
    assert pushed[-1] == "🦀"
    assert tail == ""


def test_flush_emits_incomplete_tail(bytes_tok: Tokenizer) -> None:
    ids = bytes_tok.encode("ok🦀", add_bos=False)[:-2]  # drop the emoji's last 2 bytes
    pushed, tail, detok = _stream(bytes_tok, ids)
    assert pushed == ["o", "k", "", ""]
    assert tail == "\ufffd" == bytes_tok.decode(ids)[2:]
    assert detok.text == "ok\ufffd"
    assert detok.flush() == ""  # idempotent
    with pytest.raises(RuntimeError):
        detok.push(ids[0])


def test_stream_with_prompt_context(tok: Tokenizer) -> None:
    prompt = tok.encode_chat([ChatMessage("user", "你好 🙂")])
    ids = tok.encode("héllo 你好 🚀 world", add_bos=False)
    pushed, tail, _ = _stream(tok, ids, prompt)
    assert not any("\ufffd" in p for p in pushed)
    assert "".join(pushed) + tail == tok.decode(ids)


def test_stream_prompt_ending_mid_character(bytes_tok: Tokenizer) -> None:
    # A prompt cut inside a character must not glue its bytes onto the generated ones.
    emoji = bytes_tok.encode("🦀", add_bos=False)
    prompt = bytes_tok.encode("hi", add_bos=False) + emoji[:2]
    ids = [*emoji[2:], *bytes_tok.encode("ok", add_bos=False)]
    pushed, tail, _ = _stream(bytes_tok, ids, prompt)
    assert "".join(pushed) + tail == bytes_tok.decode(ids)


def test_stream_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("你好<|eos|>🙂<|user|>x", add_bos=True)
    for skip in (True, False):
        pushed, tail, _ = _stream(tok, ids, skip_special_tokens=skip)
        assert "".join(pushed) + tail == tok.decode(ids, skip_special_tokens=skip)
    pushed, _, _ = _stream(tok, ids, skip_special_tokens=False)
    assert "<|eos|>" in pushed


def test_stream_cost_is_windowed(
    backend: tokenizers.Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = Tokenizer.from_dir(write_model_dir(tmp_path, backend, default_config()))
    ids = t.encode(" ".join(CORPUS), add_bos=False)
    assert len(ids) > 500
    expected = t.decode(ids)
    window_sizes: list[int] = []
    real_decode = t.decode

    def spy(ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        window_sizes.append(len(ids))
        return real_decode(ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(t, "decode", spy)
    pushed, tail, _ = _stream(t, ids)
    assert "".join(pushed) + tail == expected
    # Each decode covers only the last emitted token plus held-back bytes of one character,
    # never the whole sequence.
    assert max(window_sizes) <= 5


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\ufffd"), max_size=40))
def test_stream_property_random_text(
    tok: Tokenizer, backend: tokenizers.Tokenizer, text: str
) -> None:
    # A special token's literal in the text encodes to that token, which decode skips: the
    # round trip holds for every other text (hypothesis once drew "<|assistant|>").
    specials = [t.content for t in backend.get_added_tokens_decoder().values() if t.special]
    assume(not any(s in text for s in specials))
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids) == text
    pushed, tail, detok = _stream(tok, ids)
    assert not any("\ufffd" in p for p in pushed)
    assert "".join(pushed) + tail == text
    assert detok.text == text


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.integers(min_value=0, max_value=10_000), max_size=40), st.booleans(), st.booleans()
)
def test_stream_property_random_ids(
    tok: Tokenizer, bytes_tok: Tokenizer, ids: list[int], use_bytes: bool, skip: bool
) -> None:
    # Arbitrary id sequences include invalid UTF-8; the stream must still match decode().
    tokenizer = bytes_tok if use_bytes else tok
    ids = [i % tokenizer.vocab_size for i in ids]
    pushed, tail, _ = _stream(tokenizer, ids, skip_special_tokens=skip)
    assert "".join(pushed) + tail == tokenizer.decode(ids, skip_special_tokens=skip)
