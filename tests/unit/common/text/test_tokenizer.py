"""common.text.tokenizer, chat_template and detokenizer against a real byte-level BPE tokenizer
trained in-process."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from common.runtime.errors import TokenizerError
from common.text.chat_template import ChatMessage
from common.text.detokenizer import IncrementalDetokenizer
from common.text.tokenizer import Tokenizer
from tests.tiny import CORPUS, SPECIAL_TOKENS, TEMPLATE, train_tokenizer

# Mixed-script texts whose characters span 1-4 UTF-8 bytes.
UNICODE_TEXTS = [
    "hello world",
    "héllo wörld 你好 🙂",
    "🚀🎉🙂 东京 naïve",
    "a🦀b 𝄞 z",  # 🦀 and 𝄞 are not in the corpus, so they split into byte tokens
    "",
]


def _write_model_dir(
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


def _default_config(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "chat_template": TEMPLATE,
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "add_bos_token": True,
    }
    config.update(overrides)
    return config


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
        _write_model_dir(tmp_path_factory.mktemp("model"), backend, _default_config())
    )


@pytest.fixture(scope="module")
def bytes_tok(
    bytes_backend: tokenizers.Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> Tokenizer:
    return Tokenizer.from_dir(
        _write_model_dir(tmp_path_factory.mktemp("bytes"), bytes_backend, _default_config())
    )


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

    model = _write_model_dir(tmp_path / "bad_cfg", backend)
    (model / "tokenizer_config.json").write_text("[1, 2", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json"):
        Tokenizer.from_dir(model)


def test_config_is_optional(tmp_path: Path, backend: tokenizers.Tokenizer) -> None:
    t = Tokenizer.from_dir(_write_model_dir(tmp_path, backend))
    assert t.bos_token_id is None
    assert t.eos_token_ids == frozenset()
    assert not t.has_chat_template
    assert not t.add_bos_token
    assert t.encode("hello") == backend.encode("hello", add_special_tokens=False).ids


def test_token_dict_forms_accepted(tmp_path: Path, backend: tokenizers.Tokenizer) -> None:
    config = _default_config(
        bos_token={"__type": "AddedToken", "content": "<|bos|>", "special": True},
        eos_token={"content": "<|eos|>", "lstrip": False},
    )
    t = Tokenizer.from_dir(_write_model_dir(tmp_path, backend, config))
    assert t.bos_token == "<|bos|>"
    assert t.bos_token_id == backend.token_to_id("<|bos|>")
    assert t.eos_token_ids == frozenset({backend.token_to_id("<|eos|>")})
    assert t.apply_chat_template([ChatMessage("user", "hi")]) == (
        "<|bos|><|user|>hi<|eos|><|assistant|>"
    )


def test_bad_special_tokens_rejected(tmp_path: Path, backend: tokenizers.Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="bos_token"):
        Tokenizer.from_dir(_write_model_dir(tmp_path / "a", backend, {"bos_token": 3}))
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        Tokenizer.from_dir(_write_model_dir(tmp_path / "b", backend, {"eos_token": "<|nope|>"}))


@pytest.mark.parametrize(("eos_field", "extra"), [(2, {2}), ([2, 3], {2, 3})])
def test_generation_config_eos_ids(
    tmp_path: Path, backend: tokenizers.Tokenizer, eos_field: Any, extra: set[int]
) -> None:
    t = Tokenizer.from_dir(
        _write_model_dir(tmp_path, backend, _default_config(), {"eos_token_id": eos_field})
    )
    assert t.eos_token_ids == frozenset(extra | {backend.token_to_id("<|eos|>")})


def test_generation_config_bad_eos(tmp_path: Path, backend: tokenizers.Tokenizer) -> None:
    with pytest.raises(TokenizerError, match=r"generation_config\.json"):
        Tokenizer.from_dir(
            _write_model_dir(tmp_path, backend, _default_config(), {"eos_token_id": "x"})
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
    t = Tokenizer.from_dir(_write_model_dir(tmp_path, backend, {"chat_template": TEMPLATE}))
    assert t.encode("hi") == t.encode("hi", add_bos=False)
    with pytest.raises(TokenizerError, match="bos"):
        t.encode("hi", add_bos=True)


def test_decode_negative_id(tok: Tokenizer) -> None:
    with pytest.raises(TokenizerError):
        tok.decode([-1])


# --- chat template -----------------------------------------------------------------------


MESSAGES = [
    ChatMessage("system", "be brief"),
    ChatMessage("user", "héllo 你好 🙂"),
    ChatMessage("assistant", "hi"),
    ChatMessage("user", "bye"),
]


def test_chat_template_renders_exactly(tok: Tokenizer) -> None:
    expected = (
        "<|bos|><|system|>be brief<|eos|><|user|>héllo 你好 🙂<|eos|>"
        "<|assistant|>hi<|eos|><|user|>bye<|eos|>"
    )
    assert tok.apply_chat_template(MESSAGES) == expected + "<|assistant|>"
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == expected


def test_encode_chat_no_double_bos(tok: Tokenizer) -> None:
    # The template emits bos_token and the config says add_bos_token: BOS must appear once.
    ids = tok.encode_chat(MESSAGES)
    assert ids[0] == tok.bos_token_id
    assert ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(MESSAGES)
    assert ids[-1] == tok.encode("<|assistant|>", add_bos=False)[0]


def test_encode_chat_adds_bos_when_template_omits_it(
    tmp_path: Path, backend: tokenizers.Tokenizer
) -> None:
    config = _default_config(chat_template=TEMPLATE.removeprefix("{{ bos_token }}"))
    t = Tokenizer.from_dir(_write_model_dir(tmp_path, backend, config))
    ids = t.encode_chat([ChatMessage("user", "hi")])
    assert ids[0] == t.bos_token_id
    assert ids.count(t.bos_token_id) == 1


def test_missing_template(tmp_path: Path, backend: tokenizers.Tokenizer) -> None:
    config = _default_config()
    del config["chat_template"]
    t = Tokenizer.from_dir(_write_model_dir(tmp_path, backend, config))
    assert not t.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
        t.apply_chat_template([ChatMessage("user", "hi")])
    with pytest.raises(TokenizerError, match="no chat template"):
        t.encode_chat([ChatMessage("user", "hi")])


def test_raise_exception_from_template(tmp_path: Path, backend: tokenizers.Tokenizer) -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('first message must be from the user') }}{% endif %}" + TEMPLATE
    )
    t = Tokenizer.from_dir(
        _write_model_dir(tmp_path, backend, _default_config(chat_template=template))
    )
    assert t.apply_chat_template([ChatMessage("user", "x")]).startswith("<|bos|><|user|>x")
    with pytest.raises(TokenizerError, match="first message must be from the user"):
        t.apply_chat_template([ChatMessage("assistant", "x")])


def test_template_syntax_error(tmp_path: Path, backend: tokenizers.Tokenizer) -> None:
    config = _default_config(chat_template="{% for m in messages %}{{ m['content'] }}")
    t = Tokenizer.from_dir(_write_model_dir(tmp_path, backend, config))
    with pytest.raises(TokenizerError, match="syntax error"):
        t.apply_chat_template([ChatMessage("user", "hi")])


def test_template_is_sandboxed(tmp_path: Path, backend: tokenizers.Tokenizer) -> None:
    # Mutating the messages list is forbidden by the immutable sandbox.
    config = _default_config(chat_template="{{ messages.append(1) }}")
    t = Tokenizer.from_dir(_write_model_dir(tmp_path, backend, config))
    with pytest.raises(TokenizerError, match="failed to render"):
        t.apply_chat_template([ChatMessage("user", "hi")])


def test_named_template_list(tmp_path: Path, backend: tokenizers.Tokenizer) -> None:
    named = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": TEMPLATE},
    ]
    t = Tokenizer.from_dir(
        _write_model_dir(tmp_path / "a", backend, _default_config(chat_template=named))
    )
    assert t.apply_chat_template([ChatMessage("user", "hi")]) == (
        "<|bos|><|user|>hi<|eos|><|assistant|>"
    )

    config = _default_config(chat_template=named[:1])
    t = Tokenizer.from_dir(_write_model_dir(tmp_path / "b", backend, config))
    assert not t.has_chat_template
    with pytest.raises(TokenizerError, match="tool_use"):
        t.apply_chat_template([ChatMessage("user", "hi")])


def test_chat_message_roles() -> None:
    for role in ("system", "user", "assistant", "tool"):
        assert ChatMessage(role, "x").role == role
    with pytest.raises(TokenizerError, match="invalid chat role"):
        ChatMessage("robot", "x")


# --- incremental detokenization ----------------------------------------------------------


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
    t = Tokenizer.from_dir(_write_model_dir(tmp_path, backend, _default_config()))
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
