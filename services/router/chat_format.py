"""Pipeline outputs -> OpenAI chat completion bodies and SSE chunks.

Streaming: a first chunk with the assistant role per choice, then one chunk per Delta (with
its choice's index), a chunk with the finish_reason as each choice ends, an optional usage
chunk (empty choices, when stream_options.include_usage); the route then sends
`data: [DONE]`. Non-streaming gathers the same outputs. With tools, each choice's text is
parsed for tool calls on its way out.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from services.router.request import ChoiceEnd, Delta, Done, Output
from services.router.response_schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    FunctionCallDelta,
    FunctionCallOut,
    ToolCallDelta,
    ToolCallOut,
    TopLogprobOut,
    Usage,
)
from services.router.responses import Choices, sse, total_usage
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


def _chat_logprobs(entries: Sequence[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=e.token,
                logprob=e.logprob if e.logprob is not None else 0.0,  # chat has no prompt
                bytes=list(e.token.encode()),
                top_logprobs=[
                    TopLogprobOut(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in e.top
                ],
            )
            for e in entries
        ]
    )


class _ChatText:
    """One chat choice's text on its way out. With tools it is parsed for calls: a named
    function's arguments stream as they come; otherwise text that may open a call is held
    back and, if it does, sent as `tool_calls` deltas once complete, with finish_reason
    "tool_calls"."""

    def __init__(self, calling: ToolCalling | None) -> None:
        self.calling = calling
        self.held = ""  # text that is, or may become, tool calls
        self.held_logprobs: list[TokenLogprob] = []
        self.mode = _Stream.CONTENT
        if calling is not None:
            self.mode = {
                ToolMode.NAMED: _Stream.ARGUMENTS,
                ToolMode.REQUIRED: _Stream.CALLS,
                ToolMode.AUTO: _Stream.UNDECIDED,
            }[calling.mode]
        self.call_id = new_call_id()

    def route(self, text: str) -> str | ToolCallDelta | None:
        """What a text delta becomes on the wire: content, a call's arguments, or nothing
        yet (held back)."""
        if self.mode is _Stream.ARGUMENTS:
            if not text:
                return None
            first = not self.held
            self.held += text
            assert self.calling is not None
            return ToolCallDelta(
                index=0,
                id=self.call_id if first else None,
                type="function" if first else None,
                function=FunctionCallDelta(
                    name=self.calling.named if first else None, arguments=text
                ),
            )
        if self.mode is _Stream.CONTENT:
            if self.calling is not None and DEEPSEEK_CALLS_BEGIN in text:
                before, marker, after = text.partition(DEEPSEEK_CALLS_BEGIN)
                self.mode, self.held = _Stream.CALLS, marker + after
                return before or None
            return text
        self.held += text
        if self.mode is _Stream.UNDECIDED and not may_be_call(self.held):
            self.mode = _Stream.CONTENT
            held, self.held = self.held, ""
            return self.route(held)
        return None

    def calls(self, reason: str) -> tuple[str, list[ToolCall]] | None:
        if self.mode is _Stream.CONTENT or self.calling is None or reason != "stop":
            return None
        if self.mode is _Stream.ARGUMENTS:
            return "", [ToolCall(self.call_id, self.calling.named or "", self.held)]
        return parse(self.held, self.calling)


class ChatFormat:
    """Chat bodies and chunks, each choice's text through its own `_ChatText`."""

    def __init__(
        self,
        request_id: str,
        model: str,
        logprobs: bool,
        include_usage: bool,
        n: int = 1,
        calling: ToolCalling | None = None,
    ) -> None:
        self.id, self.model = request_id, model
        self.logprobs, self.include_usage, self.n = logprobs, include_usage, n
        self.calling = calling
        self._texts = [_ChatText(calling) for _ in range(n)]

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=self.id, model=self.model, choices=choices, usage=usage))

    def opening(self) -> list[str]:
        return [
            self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
            for i in range(self.n)
        ]

    def event(self, run: int, out: Output) -> list[str]:
        """The SSE lines of one output of run `run` (chat has one run)."""
        if isinstance(out, Delta):
            return self._delta(out)
        if isinstance(out, ChoiceEnd):
            return self._end(out)
        return []

    def _delta(self, d: Delta) -> list[str]:
        text_out = self._texts[d.index]
        # Logprobs of held-back text go out with it when it turns out to be content.
        text_out.held_logprobs.extend(d.logprobs)
        text = text_out.route(d.text)
        if text is None:
            return []
        if isinstance(text, ToolCallDelta):
            delta = ChatDelta(tool_calls=[text])
            return [self._chunk([ChatChunkChoice(index=d.index, delta=delta)])]
        entries, text_out.held_logprobs = text_out.held_logprobs, []
        lp = _chat_logprobs(entries) if self.logprobs else None
        delta = ChatDelta(content=text)
        return [self._chunk([ChatChunkChoice(index=d.index, delta=delta, logprobs=lp)])]

    def _end(self, end: ChoiceEnd) -> list[str]:
        lines = []
        i, text_out = end.index, self._texts[end.index]
        reason = end.finish_reason
        parsed = text_out.calls(reason)
        if parsed is not None:
            reason = "tool_calls"
            if text_out.mode is not _Stream.ARGUMENTS:
                deltas = [
                    ToolCallDelta(
                        index=k,
                        id=c.id,
                        type="function",
                        function=FunctionCallDelta(name=c.name, arguments=c.arguments),
                    )
                    for k, c in enumerate(parsed[1])
                ]
                delta = ChatDelta(tool_calls=deltas)
                lines.append(self._chunk([ChatChunkChoice(index=i, delta=delta)]))
        elif text_out.held and text_out.mode is not _Stream.ARGUMENTS:
            lp = _chat_logprobs(text_out.held_logprobs) if self.logprobs else None
            delta = ChatDelta(content=text_out.held)
            lines.append(self._chunk([ChatChunkChoice(index=i, delta=delta, logprobs=lp)]))
        finish = ChatChunkChoice(index=i, delta=ChatDelta(), finish_reason=reason)
        lines.append(self._chunk([finish]))
        return lines

    def closing(self, dones: Sequence[Done]) -> list[str]:
        return [self._chunk([], usage=total_usage(dones))] if self.include_usage else []

    def full(self, runs: Sequence[Sequence[Output]]) -> ChatCompletionResponse:
        got = Choices(runs, self.n)
        return ChatCompletionResponse(
            id=self.id,
            model=self.model,
            choices=[self._choice(i, got) for i in got.indices()],
            usage=total_usage(got.dones),
        )

    def _choice(self, i: int, got: Choices) -> ChatChoice:
        text, reason = got.text(i), got.reasons[i]
        message = ChatMessageOut(content=text)
        parsed = parse(text, self.calling) if self.calling and reason == "stop" else None
        if parsed is not None:
            content, calls = parsed
            reason = "tool_calls"
            message = ChatMessageOut(
                content=content or None,
                tool_calls=[
                    ToolCallOut(
                        id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)
                    )
                    for c in calls
                ],
            )
        return ChatChoice(
            index=i,
            message=message,
            logprobs=_chat_logprobs(got.entries(i)) if self.logprobs else None,
            finish_reason=reason,
        )


class _Stream(enum.Enum):
    """Where a chat stream's text goes."""

    CONTENT = "content"  # to the client as content
    UNDECIDED = "undecided"  # held: it may still open a tool call (auto)
    CALLS = "calls"  # held: tool calls, parsed at the end
    ARGUMENTS = "arguments"  # a named function's arguments, streamed as they come
