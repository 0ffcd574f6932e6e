"""The OpenAI text completion request body: one prompt or a batch of them (text or token
ids), echo and logprobs, on top of the sampling fields every request shares (schemas.py)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from services.router.schemas import (
    MAX_CHOICES,
    MAX_PROMPTS,
    MAX_TOP_LOGPROBS,
    SamplingRequest,
    Text,
    unsupported,
)

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


def _is_token_ids(v: Any) -> bool:
    # bool is an int subclass, but `true` is not a token id.
    return isinstance(v, list) and bool(v) and all(type(t) is int and t >= 0 for t in v)


class CompletionRequest(SamplingRequest):
    # One prompt (text or token ids) or a batch of them (a list of either kind).
    prompt: (
        Text
        | TokenIds
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: int | None = Field(None, ge=0, description="0 with echo: score the prompt only")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = Field(False, description="prepend the prompt (and its logprobs)")
    best_of: int | None = unsupported("only 1 or null; use n for several choices")
    suffix: Text | None = unsupported('only "" or null')

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        if isinstance(v, str) or _is_token_ids(v):
            return v
        if isinstance(v, list) and v and all(isinstance(p, str) for p in v):
            return v
        if isinstance(v, list) and v and all(_is_token_ids(p) for p in v):
            return v
        raise ValueError(
            "prompt must be a string, a non-empty list of token ids, or a non-empty list of "
            "either (a batch of prompts)"
        )

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 only scores the prompt: it needs echo")
        return self

    @model_validator(mode="after")
    def _batch_size(self) -> CompletionRequest:
        prompts = len(self.prompts)
        if prompts * self.choices > MAX_CHOICES:
            raise ValueError(
                f"{prompts} prompts x n={self.choices} is over {MAX_CHOICES} choices in one request"
            )
        return self

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """The batch: a single prompt is a batch of one."""
        if isinstance(self.prompt, str) or _is_token_ids(self.prompt):
            return [self.prompt]  # type: ignore[list-item]
        return self.prompt  # type: ignore[return-value]

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens
