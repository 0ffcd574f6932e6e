"""The tokenizer of a model directory: encode, decode, special tokens, its chat template.

Wraps the model's vocabulary (vocabulary.py: a HuggingFace ``tokenizers`` tokenizer.json, or a
tiktoken model's, tiktoken_vocabulary.py) with the optional ``tokenizer_config.json`` and
``generation_config.json``, so the rest of the server never depends on ``transformers`` nor
runs a checkpoint's code.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from common.runtime.errors import TokenizerError
from common.text.chat_template import ChatMessage, ChatTemplate, chat_template_from_config
from common.text.deepseek_v32 import DeepseekV32Encoding
from common.text.tiktoken_vocabulary import TIKTOKEN_FILE, TiktokenVocabulary
from common.text.vocabulary import HfVocabulary, Vocabulary

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# transformers >= 4.43 may save the template here instead of inside tokenizer_config.json.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
MODEL_CONFIG_FILE = "config.json"
# Models whose prompt format is code, not a template they ship: config.json's model_type.
_ENCODINGS = {"deepseek_v32": DeepseekV32Encoding}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any, field: str, source: Path) -> str | None:
    # HF configs store special tokens either as plain strings or as serialized AddedToken
    # dicts ({"__type": "AddedToken", "content": ...}).
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(
        f"{source}: {field!r} must be a string or an object with a string 'content', got {value!r}"
    )


def _eos_ids_from_generation_config(value: Any, source: Path) -> tuple[int, ...]:
    if value is None:
        return ()
    # bool is an int subclass; a JSON true/false here is a config bug, not token id 1/0.
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(value)
    raise TokenizerError(
        f"{source}: 'eos_token_id' must be an int or a list of ints, got {value!r}"
    )


def _model_type(directory: Path) -> str | None:
    """config.json's model_type, when the directory has one."""
    model_file = directory / MODEL_CONFIG_FILE
    return _read_json(model_file).get("model_type") if model_file.is_file() else None


class Tokenizer:
    """A model's vocabulary plus the HF config needed to serve chat models.

    Build it with :meth:`from_dir`. Its state is fixed after construction (the chat template
    is compiled on first use, which is idempotent), so one instance can be shared between
    threads.
    """

    def __init__(
        self,
        backend: Vocabulary,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
        extra_eos_token_ids: Sequence[int] = (),
        source: str = "<in-memory tokenizer>",
        named_templates: Sequence[str] = (),
        encoding: DeepseekV32Encoding | None = None,
    ) -> None:
        """Wrap ``backend``.

        Args:
            backend: The model's vocabulary.
            chat_template: Jinja chat template source, or None if the model has none.
            bos_token: Text of the BOS token, or None.
            eos_token: Text of the EOS token, or None.
            add_bos_token: Whether :meth:`encode` prepends BOS by default.
            extra_eos_token_ids: Further stop ids (e.g. from ``generation_config.json``).
            source: Where the tokenizer came from, used in error messages.
            named_templates: Names of named templates found when none is called
                ``"default"``; only used to explain the missing template.
            encoding: A prompt format in code that replaces the chat template (a model that
                ships none, DeepSeek-V3.2's).

        Raises:
            TokenizerError: If a special token is not in the vocabulary, an eos id is out of
                range, or ``add_bos_token`` is set without a BOS token.
        """
        self._backend = backend
        self._source = source
        self._chat_template: ChatTemplate | DeepseekV32Encoding = encoding or ChatTemplate(
            chat_template, origin=source, other_names=named_templates
        )
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._vocab_size = backend.size

        self._bos_token_id = self._require_id(bos_token, "bos_token")
        if add_bos_token and self._bos_token_id is None:
            raise TokenizerError(f"{source}: add_bos_token is true but no bos_token is set")
        self._add_bos_token = add_bos_token

        eos_ids = set(extra_eos_token_ids)
        eos_token_id = self._require_id(eos_token, "eos_token")
        if eos_token_id is not None:
            eos_ids.add(eos_token_id)
        bad = sorted(i for i in eos_ids if not 0 <= i < self._vocab_size)
        if bad:
            raise TokenizerError(
                f"{source}: eos token ids {bad} are outside the vocabulary "
                f"(size {self._vocab_size})"
            )
        self._eos_token_ids = frozenset(eos_ids)

    def _require_id(self, token: str | None, field: str) -> int | None:
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{self._source}: {field} {token!r} is not in the vocabulary")
        return token_id

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a tokenizer from a HF model directory.

        Reads ``tokenizer.json`` (or a tiktoken model's ``tiktoken.model``: required),
        ``tokenizer_config.json`` (optional: chat
        template, bos/eos tokens, ``add_bos_token``), ``chat_template.jinja`` (optional,
        takes precedence over the config's template, as in ``transformers``) and
        ``generation_config.json`` (optional: extra ``eos_token_id`` stop ids).

        Raises:
            TokenizerError: If the directory or the vocabulary file is missing, or any file
                is malformed.
        """
        directory = Path(path)
        if not directory.is_dir():
            raise TokenizerError(f"tokenizer directory {directory} does not exist")
        config_file = directory / TOKENIZER_CONFIG_FILE
        config = _read_json(config_file) if config_file.is_file() else {}
        tokenizer_file = directory / TOKENIZER_FILE
        backend: Vocabulary
        if tokenizer_file.is_file():
            backend = HfVocabulary.from_file(tokenizer_file)
        elif (directory / TIKTOKEN_FILE).is_file():
            backend = TiktokenVocabulary.from_dir(directory, config, _model_type(directory))
        else:
            raise TokenizerError(f"no {TOKENIZER_FILE} in {directory} (nor a {TIKTOKEN_FILE})")
        chat_template, other_templates = chat_template_from_config(
            config.get("chat_template"), config_file
        )
        template_file = directory / CHAT_TEMPLATE_FILE
        if template_file.is_file():
            try:
                chat_template = template_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise TokenizerError(f"cannot read {template_file}: {exc}") from exc

        add_bos_token = config.get("add_bos_token", False)
        if not isinstance(add_bos_token, bool):
            raise TokenizerError(
                f"{config_file}: 'add_bos_token' must be a boolean, got {add_bos_token!r}"
            )

        encoding = None
        if chat_template is None:
            kind = _ENCODINGS.get(str(_model_type(directory)))
            encoding = kind() if kind is not None else None

        generation_file = directory / GENERATION_CONFIG_FILE
        generation = _read_json(generation_file) if generation_file.is_file() else {}
        extra_eos = _eos_ids_from_generation_config(generation.get("eos_token_id"), generation_file)

        return cls(
            backend,
            chat_template=chat_template,
            bos_token=_token_text(config.get("bos_token"), "bos_token", config_file),
            eos_token=_token_text(config.get("eos_token"), "eos_token", config_file),
            add_bos_token=add_bos_token,
            extra_eos_token_ids=extra_eos,
            source=str(directory),
            named_templates=other_templates,
            encoding=encoding,
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, including added/special tokens."""
        return self._vocab_size

    @property
    def bos_token(self) -> str | None:
        """Text of the BOS token, or None."""
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        """Text of the EOS token, or None."""
        return self._eos_token

    @property
    def bos_token_id(self) -> int | None:
        """Id of the BOS token, or None if the tokenizer has none."""
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """All ids that end generation (config ``eos_token`` plus generation-config ids)."""
        return self._eos_token_ids

    @property
    def add_bos_token(self) -> bool:
        """Whether :meth:`encode` prepends BOS when ``add_bos`` is not given."""
        return self._add_bos_token

    @property
    def has_chat_template(self) -> bool:
        """Whether a chat template is available for :meth:`apply_chat_template`."""
        return self._chat_template.available

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template formats tool definitions itself (reads `tools`)."""
        return self._chat_template.reads("tools")

    @property
    def template_renders_tool_turns(self) -> bool:
        """Whether the chat template formats tool calls and tool results (`tool_calls`)."""
        return self._chat_template.reads("tool_calls")

    def template_reads(self, text: str) -> bool:
        """Whether the chat template mentions `text` (a variable, a marker it writes)."""
        return self._chat_template.reads(text)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Encode ``text`` to token ids.

        Args:
            text: Text to encode; special-token strings in it map to their ids.
            add_bos: Prepend the BOS id. Defaults to the config's ``add_bos_token``.

        Raises:
            TokenizerError: If ``add_bos`` is true but the tokenizer has no BOS token.
        """
        if add_bos is None:
            add_bos = self._add_bos_token
        # The backend's post-processor may add its own specials; we manage BOS ourselves so
        # it is never added twice.
        ids = self._backend.encode(text)
        if add_bos:
            if self._bos_token_id is None:
                raise TokenizerError(f"{self._source}: add_bos requested but no bos_token is set")
            ids.insert(0, self._bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Decode token ids to text.

        Ids outside the vocabulary are silently dropped (the ``tokenizers`` behaviour), which
        matters for models whose embedding table is padded beyond the tokenizer vocabulary.

        Raises:
            TokenizerError: If an id is negative.
        """
        try:
            return self._backend.decode(ids, skip_special_tokens)
        except OverflowError as exc:
            raise TokenizerError(f"invalid token id in {list(ids)!r}: {exc}") from exc

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """Render ``messages`` with the model's chat template (common/text/chat_template.py;
        DeepSeek-V3.2's format in code, common/text/deepseek_v32.py).

        Args:
            messages: The conversation so far.
            add_generation_prompt: Append the prefix that starts an assistant turn.
            tools: Tool definitions (OpenAI tool objects) for a template that renders them.
            variables: More names the template may read (``thinking``, ...).

        Returns:
            The rendered prompt text (special tokens appear as their text).

        Raises:
            TokenizerError: If there is no template, it does not compile or fails to render,
                or it calls ``raise_exception`` (e.g. to reject a role order).
        """
        return self._chat_template.render(
            messages,
            bos_token=self._bos_token or "",
            eos_token=self._eos_token or "",
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            variables=variables,
        )

    def encode_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Render ``messages`` with the chat template and encode the result.

        BOS is prepended per the config's ``add_bos_token`` unless the template already
        emitted it, so the prompt never starts with two BOS tokens.

        Raises:
            TokenizerError: As for :meth:`apply_chat_template`.
        """
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, variables=variables
        )
        add_bos: bool | None = None
        if self._bos_token and text.startswith(self._bos_token):
            add_bos = False
        return self.encode(text, add_bos=add_bos)
