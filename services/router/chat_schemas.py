"""The OpenAI chat completion request body: its messages, tools and tool choice, on top of
the sampling fields every request shares (schemas.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from services.router.schemas import (
    INT32_MAX,
    MAX_TOP_LOGPROBS,
    SamplingRequest,
    Text,
    unsupported,
)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: Text = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: Text


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: FunctionName


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: Text
    arguments: Text


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant turn, sent back in the conversation."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCallIn


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: Text


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    # "developer" is OpenAI's newer name for "system"; the chat template sees "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: Text | None = None
    # An earlier answer's reasoning sent back (SGLang's and DeepSeek's name, vLLM's): the
    # template decides whether it shows it (most drop it before the last user turn).
    reasoning_content: Text | None = None
    reasoning: Text | None = None
    # After the fields above: its validator reads them.
    content: Text | list[TextPart] | None = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessageIn:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.thought is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning_content")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id")
        return self

    @field_validator("content", mode="after")
    @classmethod
    def _content_given(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError(
                "content is required (only an assistant turn with tool_calls may omit it)"
            )
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            for part in v:
                if isinstance(part, dict) and part.get("type") != "text":
                    kind = part.get("type")
                    shown = repr(kind) if isinstance(kind, str) and kind.isprintable() else "?"
                    raise ValueError(
                        f"content part type {shown} is not supported: the server serves a "
                        "model's text (a multimodal checkpoint's language model), so only "
                        "'text' parts"
                    )
        return v

    @property
    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)

    @property
    def thought(self) -> str | None:
        """The reasoning it carries, under either name."""
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = unsupported("only [] or null")
    function_call: Any = unsupported('only "none" or null')
    audio: Any = unsupported("only null")
    modalities: list[Any] | None = unsupported('only ["text"] or null')
    prediction: Any = unsupported("only null")
    web_search_options: Any = unsupported("only null")
    # Reasoning models (services/router/reasoning.py).
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="vLLM extension: variables for the chat template, e.g. thinking or "
        "enable_thinking (a template without the switch ignores them)",
    )
    # Any level a template may know (OpenAI's low / medium / high and newer ones).
    reasoning_effort: Text | None = Field(
        None,
        max_length=32,
        description="passed to the chat template as reasoning_effort (where it reads it)",
    )
    thinking_token_budget: int | None = Field(
        None,
        ge=0,
        le=INT32_MAX,
        description="vLLM extension: at most this many reasoning tokens, then </think> is forced",
    )

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, v: list[ToolDef] | None) -> list[ToolDef] | None:
        names = [t.function.name for t in v or ()]
        if len(set(names)) != len(names):
            raise ValueError("tool function names must be unique")
        return v

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
