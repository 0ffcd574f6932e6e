"""OpenAI-compatible response bodies: what the router sends back (chat_format.py and
completion_format.py build them from the pipeline's outputs), and the error body every
4xx/5xx carries."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from a prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # completion tokens spent thinking (before </think>)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()
    # Only for a reasoning request, as vLLM and SGLang send it.
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, exclude_if=lambda v: v is None
    )


class TopLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprobOut):
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    # null for an echoed prompt's first token, as OpenAI sends it
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # A reasoning model's reasoning, under both names by default (TPLA_REASONING_FIELDS):
    # SGLang and DeepSeek's API send reasoning_content, vLLM now sends reasoning. Left out
    # when there is none.
    reasoning_content: str | None = Field(None, exclude_if=lambda v: v is None)
    reasoning: str | None = Field(None, exclude_if=lambda v: v is None)
    # Left out unless there are calls, as OpenAI does.
    tool_calls: list[ToolCallOut] | None = Field(None, exclude_if=lambda v: v is None)


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = Field(None, exclude_if=lambda v: v is None)
    reasoning: str | None = Field(None, exclude_if=lambda v: v is None)
    tool_calls: list[ToolCallDelta] | None = Field(None, exclude_if=lambda v: v is None)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class _Envelope(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class SamplingDefaults(BaseModel):
    """What a request gets for each sampling field it leaves out (max_tokens: at most)."""

    temperature: float
    top_p: float
    top_k: int  # 0 = off
    min_p: float
    repetition_penalty: float
    max_tokens: int
    source: str  # generation_config.json, TPLA_GENERATION_CONFIG, or the server's own


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tpla-serve"
    max_model_len: int
    sampling_defaults: SamplingDefaults  # an extension, as vLLM adds max_model_len


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every 4xx/5xx the router sends (and an SSE error event): OpenAI's error body."""

    error: ErrorDetail
