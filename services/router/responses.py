"""Pipeline outputs -> OpenAI response bodies and SSE chunks (chat and text completions).

Streaming: chat sends a first chunk with the assistant role, then one chunk per Delta, a
last chunk with the finish_reason, an optional usage chunk (empty choices, when
stream_options.include_usage) and `data: [DONE]`. Non-streaming gathers the same Deltas.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Sequence

from pydantic import BaseModel

from common.errors import TplaError
from services.router import schemas as s
from services.router.request import Delta, Done
from services.router.text import TokenLogprob
from services.router.tools import (
    DEEPSEEK_CALLS_BEGIN,
    ToolCall,
    ToolCalling,
    ToolMode,
    may_be_call,
    new_call_id,
    parse,
)

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
    """Chat bodies and chunks. With tools, the text is parsed for calls: a named function's
    arguments stream as they come; otherwise text that may open a call is held back and, if
    it does, sent as `tool_calls` deltas once complete, with finish_reason "tool_calls"."""

    def __init__(
        self,
        request_id: str,
        model: str,
        logprobs: bool,
        include_usage: bool,
        calling: ToolCalling | None = None,
    ) -> None:
        self.id, self.model = request_id, model
        self.logprobs, self.include_usage = logprobs, include_usage
        self.calling = calling
        self._held = ""  # text that is, or may become, tool calls
        self._held_logprobs: list[TokenLogprob] = []
        self._mode = _Stream.CONTENT
        if calling is not None:
            self._mode = {
                ToolMode.NAMED: _Stream.ARGUMENTS,
                ToolMode.REQUIRED: _Stream.CALLS,
                ToolMode.AUTO: _Stream.UNDECIDED,
            }[calling.mode]
        self._call_id = new_call_id()

    def _chunk(self, choices: list[s.ChatChunkChoice], usage: s.Usage | None = None) -> str:
        return sse(
            s.ChatCompletionChunk(id=self.id, model=self.model, choices=choices, usage=usage)
        )

    def opening(self) -> list[str]:
        return [self._chunk([s.ChatChunkChoice(delta=s.ChatDelta(role="assistant", content=""))])]

    def delta(self, d: Delta) -> str:
        # Logprobs of held-back text go out with it when it turns out to be content.
        self._held_logprobs.extend(d.logprobs)
        text = self._route(d.text)
        if text is None:
            return ""
        if isinstance(text, s.ToolCallDelta):
            return self._chunk([s.ChatChunkChoice(delta=s.ChatDelta(tool_calls=[text]))])
        entries, self._held_logprobs = self._held_logprobs, []
        lp = _chat_logprobs(entries) if self.logprobs else None
        return self._chunk([s.ChatChunkChoice(delta=s.ChatDelta(content=text), logprobs=lp)])

    def _route(self, text: str) -> str | s.ToolCallDelta | None:
        """What a text delta becomes on the wire: content, a call's arguments, or nothing
        yet (held back)."""
        if self._mode is _Stream.ARGUMENTS:
            if not text:
                return None
            first = not self._held
            self._held += text
            assert self.calling is not None
            return s.ToolCallDelta(
                index=0,
                id=self._call_id if first else None,
                type="function" if first else None,
                function=s.FunctionCallDelta(
                    name=self.calling.named if first else None, arguments=text
                ),
            )
        if self._mode is _Stream.CONTENT:
            if self.calling is not None and DEEPSEEK_CALLS_BEGIN in text:
                before, marker, after = text.partition(DEEPSEEK_CALLS_BEGIN)
                self._mode, self._held = _Stream.CALLS, marker + after
                return before or None
            return text
        self._held += text
        if self._mode is _Stream.UNDECIDED and not may_be_call(self._held):
            self._mode = _Stream.CONTENT
            held, self._held = self._held, ""
            return self._route(held)
        return None

    def _calls(self, reason: str) -> tuple[str, list[ToolCall]] | None:
        if self.calling is None or reason != "stop":
            return None
        if self._mode is _Stream.ARGUMENTS:
            return "", [ToolCall(self._call_id, self.calling.named or "", self._held)]
        return parse(self._held, self.calling)

    def closing(self, done: Done) -> list[str]:
        lines = []
        reason = done.finish_reason
        parsed = self._calls(reason) if self._mode is not _Stream.CONTENT else None
        if parsed is not None:
            reason = "tool_calls"
            if self._mode is not _Stream.ARGUMENTS:
                deltas = [
                    s.ToolCallDelta(
                        index=i,
                        id=c.id,
                        type="function",
                        function=s.FunctionCallDelta(name=c.name, arguments=c.arguments),
                    )
                    for i, c in enumerate(parsed[1])
                ]
                lines.append(self._chunk([s.ChatChunkChoice(delta=s.ChatDelta(tool_calls=deltas))]))
        elif self._held and self._mode is not _Stream.ARGUMENTS:
            lp = _chat_logprobs(self._held_logprobs) if self.logprobs else None
            lines.append(
                self._chunk([s.ChatChunkChoice(delta=s.ChatDelta(content=self._held), logprobs=lp)])
            )
        lines.append(self._chunk([s.ChatChunkChoice(delta=s.ChatDelta(), finish_reason=reason)]))
        if self.include_usage:
            lines.append(self._chunk([], usage=_usage(done)))
        return lines

    def full(self, deltas: Iterable[Delta], done: Done) -> s.ChatCompletionResponse:
        deltas = list(deltas)
        entries = [e for d in deltas for e in d.logprobs]
        text = "".join(d.text for d in deltas)
        message = s.ChatMessageOut(content=text)
        reason = done.finish_reason
        parsed = parse(text, self.calling) if self.calling and reason == "stop" else None
        if parsed is not None:
            content, calls = parsed
            reason = "tool_calls"
            message = s.ChatMessageOut(
                content=content or None,
                tool_calls=[
                    s.ToolCallOut(
                        id=c.id, function=s.FunctionCallOut(name=c.name, arguments=c.arguments)
                    )
                    for c in calls
                ],
            )
        return s.ChatCompletionResponse(
            id=self.id,
            model=self.model,
            choices=[
                s.ChatChoice(
                    message=message,
                    logprobs=_chat_logprobs(entries) if self.logprobs else None,
                    finish_reason=reason,
                )
            ],
            usage=_usage(done),
        )


class _Stream(enum.Enum):
    """Where a chat stream's text goes."""

    CONTENT = "content"  # to the client as content
    UNDECIDED = "undecided"  # held: it may still open a tool call (auto)
    CALLS = "calls"  # held: tool calls, parsed at the end
    ARGUMENTS = "arguments"  # a named function's arguments, streamed as they come


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
