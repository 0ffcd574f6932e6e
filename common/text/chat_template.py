"""Chat templates: the messages of a chat request -> the model's prompt text.

A model directory's template is Jinja source from `tokenizer_config.json` (a string, or named
templates of which "default" is used) or `chat_template.jinja`. Templates come from
downloaded model repos, so they are untrusted code and run in Jinja's sandbox; every failure,
including a template's own `raise_exception`, is a TokenizerError (bad input, not a server
error).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.sandbox

from common.runtime.errors import TokenizerError

# "developer": a prompt format may treat it apart from "system" (DeepSeek-V3.2's does).
CHAT_ROLES: frozenset[str] = frozenset({"system", "developer", "user", "assistant", "tool"})
# What render() passes itself: a request's template variables may not replace them.
RESERVED_VARIABLES: frozenset[str] = frozenset(
    {"messages", "tools", "bos_token", "eos_token", "add_generation_prompt", "raise_exception"}
)


class ToolArguments(str):
    """An earlier call's arguments as chat templates read them: the JSON text (a string to
    `is string`, printed as it is by DeepSeek's and Kimi's templates) that is also the object's
    mapping (GLM's template iterates `arguments.items()`)."""

    def _mapping(self) -> dict[str, Any]:
        try:
            value = json.loads(self)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}

    def items(self) -> Any:
        return self._mapping().items()

    def keys(self) -> Any:
        return self._mapping().keys()

    def values(self) -> Any:
        return self._mapping().values()


@dataclass(frozen=True)
class ChatMessage:
    """One chat turn passed to a chat template.

    Attributes:
        role: One of ``"system"``, ``"user"``, ``"assistant"`` or ``"tool"``.
        content: The message text.
    """

    role: str
    content: str
    # An assistant turn's tool calls as (id, function name, arguments JSON); a tool turn's
    # answer names its call in tool_call_id.
    tool_calls: tuple[tuple[str, str, str], ...] = ()
    tool_call_id: str | None = None
    # An earlier assistant turn's reasoning, sent back by the client (templates that show it
    # read `reasoning_content`; most drop it before the last user turn).
    reasoning_content: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as HF chat templates read it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": i,
                    "type": "function",
                    "function": {"name": n, "arguments": ToolArguments(a)},
                }
                for i, n, a in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def __post_init__(self) -> None:
        if self.role not in CHAT_ROLES:
            raise TokenizerError(
                f"invalid chat role {self.role!r}; expected one of {sorted(CHAT_ROLES)}"
            )
        if not isinstance(self.content, str):
            raise TokenizerError(
                f"chat message content must be a str, got {type(self.content).__name__}"
            )


def chat_template_from_config(value: Any, source: Path) -> tuple[str | None, list[str]]:
    """Return the default template (or None) and the names of the other named templates."""
    if value is None or isinstance(value, str):
        return value, []
    if isinstance(value, list):
        names: list[str] = []
        for entry in value:
            if not (
                isinstance(entry, Mapping)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise TokenizerError(
                    f"{source}: 'chat_template' list entries must be objects with string "
                    f"'name' and 'template', got {entry!r}"
                )
            if entry["name"] == "default":
                return entry["template"], []
            names.append(entry["name"])
        # Not fatal: the model can still serve plain completions without a chat template.
        return None, names
    raise TokenizerError(
        f"{source}: 'chat_template' must be a string or a list of named templates, "
        f"got {type(value).__name__}"
    )


def check_variables(variables: Mapping[str, Any] | None) -> None:
    """TokenizerError when a request's template variables name one render() passes itself."""
    taken = sorted(RESERVED_VARIABLES.intersection(variables or {}))
    if taken:
        raise TokenizerError(f"chat_template_kwargs may not set {taken}")


def _raise_template_exception(message: str) -> NoReturn:
    raise TokenizerError(f"chat template error: {message}")


def _tojson(value: Any, indent: int | None = None) -> str:
    # Jinja's built-in tojson HTML-escapes <, >, & and '; HF templates expect plain JSON.
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ChatTemplate:
    """A model's chat template, compiled on first use (idempotent, so one instance can be
    shared between threads) so a broken template only affects chat requests."""

    def __init__(self, source: str | None, *, origin: str, other_names: Sequence[str] = ()) -> None:
        """`source` is the Jinja text or None; `origin` names where it came from in errors;
        `other_names` are the named templates found when none is called "default"."""
        self._source = source
        self._origin = origin
        self._other_names = tuple(other_names)
        self._compiled: jinja2.Template | None = None

    @property
    def available(self) -> bool:
        return self._source is not None

    def reads(self, variable: str) -> bool:
        """Whether the template's source mentions `variable` (e.g. `tools`, `tool_calls`)."""
        return self._source is not None and variable in self._source

    def _compile(self) -> jinja2.Template:
        if self._compiled is not None:
            return self._compiled
        if self._source is None:
            if self._other_names:
                raise TokenizerError(
                    f"{self._origin}: no chat template named 'default' (found "
                    f"{list(self._other_names)})"
                )
            raise TokenizerError(
                f"{self._origin}: the tokenizer has no chat template (no 'chat_template' in "
                "tokenizer_config.json and no chat_template.jinja)"
            )
        # Templates come from downloaded model repos, so they are untrusted code: sandbox them.
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols],
        )
        env.globals["raise_exception"] = _raise_template_exception
        env.filters["tojson"] = _tojson
        try:
            template = env.from_string(self._source)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(
                f"{self._origin}: chat template syntax error at line {exc.lineno}: {exc.message}"
            ) from exc
        self._compiled = template
        return template

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        bos_token: str,
        eos_token: str,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text (special tokens appear as their text); TokenizerError if there is
        no template, it does not compile or fails to render, or it rejects the messages.
        `variables`: more names the template may read (a request's chat_template_kwargs:
        `thinking`, `enable_thinking`, `reasoning_effort`, ...); a template ignores those it
        does not use."""
        check_variables(variables)
        template = self._compile()
        for message in messages:
            if not isinstance(message, ChatMessage):
                raise TokenizerError(
                    f"messages must be ChatMessage instances, got {type(message).__name__}"
                )
        try:
            extra = {} if tools is None else {"tools": list(tools)}
            return template.render(
                **(variables or {}),
                messages=[m.template_dict() for m in messages],
                **extra,
                bos_token=bos_token,
                eos_token=eos_token,
                add_generation_prompt=add_generation_prompt,
            )
        except TokenizerError:
            raise  # from raise_exception(): already says what the template rejected
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError) as exc:
            # Template bugs triggered by request content must surface as bad input, not as
            # internal server errors.
            raise TokenizerError(f"{self._origin}: chat template failed to render: {exc}") from exc
