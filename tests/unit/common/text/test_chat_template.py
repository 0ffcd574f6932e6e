"""common.text.chat_template through the tokenizer: exact rendering, BOS handling, clear errors
for missing or broken templates, and a sandboxed template engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers

from common.runtime.errors import TokenizerError
from common.text.chat_template import ChatMessage
from common.text.tokenizer import Tokenizer
from tests.tiny import TEMPLATE
from tests.unit.common.text.tokenizer_files import default_config, write_model_dir

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
    config = default_config(chat_template=TEMPLATE.removeprefix("{{ bos_token }}"))
    t = Tokenizer.from_dir(write_model_dir(tmp_path, backend, config))
    ids = t.encode_chat([ChatMessage("user", "hi")])
    assert ids[0] == t.bos_token_id
    assert ids.count(t.bos_token_id) == 1


def test_missing_template(tmp_path: Path, backend: tokenizers.Tokenizer) -> None:
    config = default_config()
    del config["chat_template"]
    t = Tokenizer.from_dir(write_model_dir(tmp_path, backend, config))
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
        write_model_dir(tmp_path, backend, default_config(chat_template=template))
    )
    assert t.apply_chat_template([ChatMessage("user", "x")]).startswith("<|bos|><|user|>x")
    with pytest.raises(TokenizerError, match="first message must be from the user"):
        t.apply_chat_template([ChatMessage("assistant", "x")])


def test_template_syntax_error(tmp_path: Path, backend: tokenizers.Tokenizer) -> None:
    config = default_config(chat_template="{% for m in messages %}{{ m['content'] }}")
    t = Tokenizer.from_dir(write_model_dir(tmp_path, backend, config))
    with pytest.raises(TokenizerError, match="syntax error"):
        t.apply_chat_template([ChatMessage("user", "hi")])


def test_template_is_sandboxed(tmp_path: Path, backend: tokenizers.Tokenizer) -> None:
    # Mutating the messages list is forbidden by the immutable sandbox.
    config = default_config(chat_template="{{ messages.append(1) }}")
    t = Tokenizer.from_dir(write_model_dir(tmp_path, backend, config))
    with pytest.raises(TokenizerError, match="failed to render"):
        t.apply_chat_template([ChatMessage("user", "hi")])


def test_named_template_list(tmp_path: Path, backend: tokenizers.Tokenizer) -> None:
    named = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": TEMPLATE},
    ]
    t = Tokenizer.from_dir(
        write_model_dir(tmp_path / "a", backend, default_config(chat_template=named))
    )
    assert t.apply_chat_template([ChatMessage("user", "hi")]) == (
        "<|bos|><|user|>hi<|eos|><|assistant|>"
    )

    config = default_config(chat_template=named[:1])
    t = Tokenizer.from_dir(write_model_dir(tmp_path / "b", backend, config))
    assert not t.has_chat_template
    with pytest.raises(TokenizerError, match="tool_use"):
        t.apply_chat_template([ChatMessage("user", "hi")])


def test_chat_message_roles() -> None:
    for role in ("system", "user", "assistant", "tool"):
        assert ChatMessage(role, "x").role == role
    with pytest.raises(TokenizerError, match="invalid chat role"):
        ChatMessage("robot", "x")


def test_template_variables_and_earlier_reasoning(
    tmp_path: Path, backend: tokenizers.Tokenizer
) -> None:
    template = (
        "{% for m in messages %}{{ m.get('reasoning_content', '-') }}|{% endfor %}"
        "{{ reasoning_effort | default('none') }}|{{ thinking is defined and thinking }}"
    )
    config = default_config(chat_template=template)
    t = Tokenizer.from_dir(write_model_dir(tmp_path, backend, config))
    messages = [ChatMessage("user", "q"), ChatMessage("assistant", "a", reasoning_content="r")]
    assert t.apply_chat_template(messages) == "-|r|none|False"
    variables = {"reasoning_effort": "high", "thinking": True}
    assert t.apply_chat_template(messages, variables=variables) == "-|r|high|True"
    with pytest.raises(TokenizerError, match="may not set"):
        t.apply_chat_template(messages, variables={"messages": []})
