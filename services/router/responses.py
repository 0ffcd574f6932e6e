"""Pipeline outputs -> OpenAI response bodies and SSE chunks (chat and text completions).

Streaming: chat sends a first chunk with the assistant role per choice, then one chunk per
Delta (with its choice's index), a chunk with the finish_reason as each choice ends, an
optional usage chunk (empty choices, when stream_options.include_usage) and `data: [DONE]`.
Non-streaming gathers the same outputs. A completions request with a batch of prompts is one
pipeline run per prompt; run k's choice j is choice k * n + j of the response (OpenAI's
order), and usage sums the runs. With echo, each choice starts with its prompt (and, with
logprobs, the prompt's logprobs, the first token's null).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence

from pydantic import BaseModel

from common.runtime.errors import TplaError
from services.router import response_schemas as s
from services.router.request import ChoiceEnd, Delta, Done, Output, Prompt
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


def _usage(dones: Sequence[Done]) -> s.Usage:
    prompt = sum(d.prompt_tokens for d in dones)
    completion = sum(d.completion_tokens for d in dones)
    return s.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=s.PromptTokensDetails(
            cached_tokens=sum(d.cached_tokens for d in dones)
        ),
    )


def _chat_logprobs(entries: Sequence[TokenLogprob]) -> s.ChatLogprobs:
    return s.ChatLogprobs(
        content=[
            s.ChatTokenLogprob(
                token=e.token,
                logprob=e.logprob if e.logprob is not None else 0.0,  # chat has no prompt
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
        # OpenAI: the echoed prompt's first token has null for both.
        out.top_logprobs.append(dict(e.top) if e.logprob is not None else None)
        out.text_offset.append(offset)
        offset += len(e.token)
    return out


class _Choices:
    """Each choice's outputs of a non-streaming response, by response index."""

    def __init__(self, runs: Sequence[Sequence[Output]], n: int) -> None:
        self.prompt: dict[int, Prompt] = {}
        self.deltas: dict[int, list[Delta]] = {}
        self.dones = [o for outs in runs for o in outs if isinstance(o, Done)]
        self.reasons: dict[int, str] = {}
        for k, outs in enumerate(runs):
            for o in outs:
                if isinstance(o, Prompt):
                    for j in range(n):
                        self.prompt[k * n + j] = o
                elif isinstance(o, Delta):
                    self.deltas.setdefault(k * n + o.index, []).append(o)
                elif isinstance(o, ChoiceEnd):
                    self.reasons[k * n + o.index] = o.finish_reason

    def indices(self) -> list[int]:
        return sorted(self.reasons)

    def text(self, index: int) -> str:
        return "".join(d.text for d in self.deltas.get(index, ()))

    def entries(self, index: int) -> list[TokenLogprob]:
        return [e for d in self.deltas.get(index, ()) for e in d.logprobs]


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

    def route(self, text: str) -> str | s.ToolCallDelta | None:
        """What a text delta becomes on the wire: content, a call's arguments, or nothing
        yet (held back)."""
        if self.mode is _Stream.ARGUMENTS:
            if not text:
                return None
            first = not self.held
            self.held += text
            assert self.calling is not None
            return s.ToolCallDelta(
                index=0,
                id=self.call_id if first else None,
                type="function" if first else None,
                function=s.FunctionCallDelta(
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

    def _chunk(self, choices: list[s.ChatChunkChoice], usage: s.Usage | None = None) -> str:
        return sse(
            s.ChatCompletionChunk(id=self.id, model=self.model, choices=choices, usage=usage)
        )

    def opening(self) -> list[str]:
        return [
            self._chunk(
                [s.ChatChunkChoice(index=i, delta=s.ChatDelta(role="assistant", content=""))]
            )
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
        if isinstance(text, s.ToolCallDelta):
            delta = s.ChatDelta(tool_calls=[text])
            return [self._chunk([s.ChatChunkChoice(index=d.index, delta=delta)])]
        entries, text_out.held_logprobs = text_out.held_logprobs, []
        lp = _chat_logprobs(entries) if self.logprobs else None
        delta = s.ChatDelta(content=text)
        return [self._chunk([s.ChatChunkChoice(index=d.index, delta=delta, logprobs=lp)])]

    def _end(self, end: ChoiceEnd) -> list[str]:
        lines = []
        i, text_out = end.index, self._texts[end.index]
        reason = end.finish_reason
        parsed = text_out.calls(reason)
        if parsed is not None:
            reason = "tool_calls"
            if text_out.mode is not _Stream.ARGUMENTS:
                deltas = [
                    s.ToolCallDelta(
                        index=k,
                        id=c.id,
                        type="function",
                        function=s.FunctionCallDelta(name=c.name, arguments=c.arguments),
                    )
                    for k, c in enumerate(parsed[1])
                ]
                delta = s.ChatDelta(tool_calls=deltas)
                lines.append(self._chunk([s.ChatChunkChoice(index=i, delta=delta)]))
        elif text_out.held and text_out.mode is not _Stream.ARGUMENTS:
            lp = _chat_logprobs(text_out.held_logprobs) if self.logprobs else None
            delta = s.ChatDelta(content=text_out.held)
            lines.append(self._chunk([s.ChatChunkChoice(index=i, delta=delta, logprobs=lp)]))
        finish = s.ChatChunkChoice(index=i, delta=s.ChatDelta(), finish_reason=reason)
        lines.append(self._chunk([finish]))
        return lines

    def closing(self, dones: Sequence[Done]) -> list[str]:
        return [self._chunk([], usage=_usage(dones))] if self.include_usage else []

    def full(self, runs: Sequence[Sequence[Output]]) -> s.ChatCompletionResponse:
        got = _Choices(runs, self.n)
        return s.ChatCompletionResponse(
            id=self.id,
            model=self.model,
            choices=[self._choice(i, got) for i in got.indices()],
            usage=_usage(got.dones),
        )

    def _choice(self, i: int, got: _Choices) -> s.ChatChoice:
        text, reason = got.text(i), got.reasons[i]
        message = s.ChatMessageOut(content=text)
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
        return s.ChatChoice(
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


class CompletionFormat:
    def __init__(
        self, request_id: str, model: str, logprobs: bool, include_usage: bool, n: int = 1
    ) -> None:
        self.id, self.model = request_id, model
        self.logprobs, self.include_usage, self.n = logprobs, include_usage, n
        self._offsets: dict[int, int] = {}  # streaming: text sent so far, per choice

    def _chunk(self, choices: list[s.CompletionChoice], usage: s.Usage | None = None) -> str:
        return sse(s.CompletionResponse(id=self.id, model=self.model, choices=choices, usage=usage))

    def opening(self) -> list[str]:
        return []

    def event(self, run: int, out: Output) -> list[str]:
        """The SSE lines of one output of prompt `run` of the batch."""
        if isinstance(out, Prompt):  # echo: every choice of this prompt starts with it
            lp = _completion_logprobs(out.logprobs, 0) if self.logprobs else None
            lines = []
            for j in range(self.n):
                self._offsets[run * self.n + j] = len(out.text)
                choice = s.CompletionChoice(index=run * self.n + j, text=out.text, logprobs=lp)
                lines.append(self._chunk([choice]))
            return lines
        if isinstance(out, Delta):
            index = run * self.n + out.index
            offset = self._offsets.get(index, 0)
            lp = _completion_logprobs(out.logprobs, offset) if self.logprobs else None
            self._offsets[index] = offset + len(out.text)
            return [self._chunk([s.CompletionChoice(index=index, text=out.text, logprobs=lp)])]
        if isinstance(out, ChoiceEnd):
            index = run * self.n + out.index
            end = s.CompletionChoice(index=index, text="", finish_reason=out.finish_reason)
            return [self._chunk([end])]
        return []

    def closing(self, dones: Sequence[Done]) -> list[str]:
        return [self._chunk([], usage=_usage(dones))] if self.include_usage else []

    def full(self, runs: Sequence[Sequence[Output]]) -> s.CompletionResponse:
        got = _Choices(runs, self.n)
        choices = []
        for i in got.indices():
            prompt = got.prompt.get(i)
            head = prompt.text if prompt is not None else ""
            logprobs = None
            if self.logprobs:
                logprobs = _completion_logprobs(
                    [*(prompt.logprobs if prompt is not None else ()), *got.entries(i)], 0
                )
                # Completion tokens' offsets continue after the echoed prompt's text.
                skip = len(prompt.logprobs) if prompt is not None else 0
                offset = len(head)
                for pos in range(skip, len(logprobs.tokens)):
                    logprobs.text_offset[pos] = offset
                    offset += len(logprobs.tokens[pos])
            choices.append(
                s.CompletionChoice(
                    index=i,
                    text=head + got.text(i),
                    logprobs=logprobs,
                    finish_reason=got.reasons[i],
                )
            )
        return s.CompletionResponse(
            id=self.id, model=self.model, choices=choices, usage=_usage(got.dones)
        )


ResponseFormat = ChatFormat | CompletionFormat


# -- OpenAPI ------------------------------------------------------------------------------------
