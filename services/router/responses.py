"""Pipeline outputs -> OpenAI response bodies and SSE chunks (chat and text completions).

Streaming: chat sends a first chunk with the assistant role, then one chunk per Delta, a
last chunk with the finish_reason, an optional usage chunk (empty choices, when
stream_options.include_usage) and `data: [DONE]`. Non-streaming gathers the same Deltas.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from pydantic import BaseModel

from common.errors import TplaError
from services.router import schemas as s
from services.router.request import Delta, Done
from services.router.text import TokenLogprob

DONE_LINE = "data: [DONE]\n\n"


def sse(body: BaseModel | dict[str, object]) -> str:
    payload = body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body)
    return f"data: {payload}\n\n"


def sse_error(error: TplaError) -> str:
    """A failure after the stream started: the headers (200) are gone, so say it in-band."""
    return sse(error.openai_body())


def _usage(done: Done) -> s.Usage:
    return s.Usage(
        prompt_tokens=done.prompt_tokens,
        completion_tokens=done.completion_tokens,
        total_tokens=done.prompt_tokens + done.completion_tokens,
        prompt_tokens_details=s.PromptTokensDetails(cached_tokens=done.cached_tokens),
    )


def _chat_logprobs(entries: Sequence[TokenLogprob]) -> s.ChatLogprobs:
    return s.ChatLogprobs(
        content=[
            s.ChatTokenLogprob(
                token=e.token,
                logprob=e.logprob,
                bytes=list(e.token.encode()),
                top_logprobs=[
                    s.TopLogprobOut(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in e.top
                ],
            )
            for e in entries
        ]
    )


def _completion_logprobs(entries: Sequence[TokenLogprob], offset: int) -> s.CompletionLogprobs:
    out = s.CompletionLogprobs()
    for e in entries:
        out.tokens.append(e.token)
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append(dict(e.top))
        out.text_offset.append(offset)
        offset += len(e.token)
    return out


class ChatFormat:
    def __init__(self, request_id: str, model: str, logprobs: bool, include_usage: bool) -> None:
        self.id, self.model = request_id, model
        self.logprobs, self.include_usage = logprobs, include_usage

    def _chunk(self, choices: list[s.ChatChunkChoice], usage: s.Usage | None = None) -> str:
        return sse(
            s.ChatCompletionChunk(id=self.id, model=self.model, choices=choices, usage=usage)
        )

    def opening(self) -> list[str]:
        return [self._chunk([s.ChatChunkChoice(delta=s.ChatDelta(role="assistant", content=""))])]

    def delta(self, d: Delta) -> str:
        lp = _chat_logprobs(d.logprobs) if self.logprobs else None
        return self._chunk([s.ChatChunkChoice(delta=s.ChatDelta(content=d.text), logprobs=lp)])

    def closing(self, done: Done) -> list[str]:
        lines = [
            self._chunk([s.ChatChunkChoice(delta=s.ChatDelta(), finish_reason=done.finish_reason)])
        ]
        if self.include_usage:
            lines.append(self._chunk([], usage=_usage(done)))
        return lines

    def full(self, deltas: Iterable[Delta], done: Done) -> s.ChatCompletionResponse:
        deltas = list(deltas)
        entries = [e for d in deltas for e in d.logprobs]
        return s.ChatCompletionResponse(
            id=self.id,
            model=self.model,
            choices=[
                s.ChatChoice(
                    message=s.ChatMessageOut(content="".join(d.text for d in deltas)),
                    logprobs=_chat_logprobs(entries) if self.logprobs else None,
                    finish_reason=done.finish_reason,
                )
            ],
            usage=_usage(done),
        )


class CompletionFormat:
    def __init__(self, request_id: str, model: str, logprobs: bool, include_usage: bool) -> None:
        self.id, self.model = request_id, model
        self.logprobs, self.include_usage = logprobs, include_usage
        self._offset = 0

    def _chunk(self, choices: list[s.CompletionChoice], usage: s.Usage | None = None) -> str:
        return sse(s.CompletionResponse(id=self.id, model=self.model, choices=choices, usage=usage))

    def opening(self) -> list[str]:
        return []

    def delta(self, d: Delta) -> str:
        lp = _completion_logprobs(d.logprobs, self._offset) if self.logprobs else None
        self._offset += len(d.text)
        return self._chunk([s.CompletionChoice(text=d.text, logprobs=lp)])

    def closing(self, done: Done) -> list[str]:
        lines = [self._chunk([s.CompletionChoice(text="", finish_reason=done.finish_reason)])]
        if self.include_usage:
            lines.append(self._chunk([], usage=_usage(done)))
        return lines

    def full(self, deltas: Iterable[Delta], done: Done) -> s.CompletionResponse:
        deltas = list(deltas)
        entries = [e for d in deltas for e in d.logprobs]
        return s.CompletionResponse(
            id=self.id,
            model=self.model,
            choices=[
                s.CompletionChoice(
                    text="".join(d.text for d in deltas),
                    logprobs=_completion_logprobs(entries, 0) if self.logprobs else None,
                    finish_reason=done.finish_reason,
                )
            ],
            usage=_usage(done),
        )


ResponseFormat = ChatFormat | CompletionFormat


# -- OpenAPI ------------------------------------------------------------------------------------
