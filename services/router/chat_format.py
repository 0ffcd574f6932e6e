"""Pipeline outputs -> OpenAI chat completion bodies and SSE chunks.

Streaming: a first chunk with the assistant role per choice, then one chunk per Delta (with
its choice's index), a chunk with the finish_reason as each choice ends, an optional usage
chunk (empty choices, when stream_options.include_usage); the route then sends
`data: [DONE]`. Non-streaming gathers the same outputs. A streamed choice's text goes out
through chat_text.py (a thinking request's reasoning apart from its content, tool calls as
they form); a whole one is split by reasoning.split and parsed by tools.parse (every
complete call, even when the output is cut off after it): the references the streamed
path is tested against. The reasoning goes out under each name of `reasoning_fields`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.router import reasoning
from services.router.body_parts import Choices, sse, total_usage
from services.router.chat_text import ChatText, Routed
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
    FunctionCallOut,
    ToolCallOut,
    TopLogprobOut,
    Usage,
)
from services.router.text import TokenLogprob
from services.router.tools import ToolCalling, parse, parse_reasoning

# Where the reasoning goes (TPLA_REASONING_FIELDS: both, or one of them).
REASONING_FIELDS = ("reasoning_content", "reasoning")


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


class ChatFormat:
    """Chat bodies and chunks, each choice's text through its own `ChatText`."""

    def __init__(
        self,
        request_id: str,
        model: str,
        logprobs: bool,
        include_usage: bool,
        n: int = 1,
        calling: ToolCalling | None = None,
        thinking: bool = False,
        reasoning_fields: tuple[str, ...] = REASONING_FIELDS,
    ) -> None:
        self.id, self.model = request_id, model
        self.logprobs, self.include_usage, self.n = logprobs, include_usage, n
        self.calling = calling
        self.thinking = thinking
        self.fields = reasoning_fields
        self._texts = [
            ChatText(calling, reasoning.ReasoningSplitter(True) if thinking else None)
            for _ in range(n)
        ]
        self._held_logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]

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
        self._held_logprobs[d.index].extend(d.logprobs)
        return self._out(d.index, text_out.route(d.text))

    def _out(self, i: int, routed: Routed) -> list[str]:
        """The chunks of choice `i`'s reasoning and content, then its tool_calls deltas, if
        any (held logprobs go out with the first text)."""
        lines = []
        if routed.content is not None or routed.reasoning is not None:
            held, self._held_logprobs[i] = self._held_logprobs[i], []
            lp = _chat_logprobs(held) if self.logprobs else None
            delta = ChatDelta(content=routed.content, **self._reasoning(routed.reasoning))
            lines.append(self._chunk([ChatChunkChoice(index=i, delta=delta, logprobs=lp)]))
        if routed.calls:
            delta = ChatDelta(tool_calls=routed.calls)
            lines.append(self._chunk([ChatChunkChoice(index=i, delta=delta)]))
        return lines

    def _reasoning(self, text: str | None) -> dict[str, Any]:
        """The reasoning under each of the names it is sent as."""
        return dict.fromkeys(self.fields, text)

    def _end(self, end: ChoiceEnd) -> list[str]:
        i = end.index
        routed, reason = self._texts[i].finish(end.finish_reason)
        lines = self._out(i, routed)
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
        reason = got.reasons[i]
        thought, text = reasoning.split(got.text(i), self.thinking)
        early = []  # calls inside the reasoning (DSML)
        if self.calling is not None:
            thought, early = parse_reasoning(thought, self.calling)
        shown = self._reasoning(thought or None)
        message = ChatMessageOut(content=text, **shown)
        parsed = parse(text, self.calling) if self.calling else None
        if parsed is not None or early:
            # Every complete call, also when the output was cut off after it (a call cut
            # off itself is dropped); "tool_calls" only when the model ended the output.
            content, calls = parsed if parsed is not None else (text, [])
            calls = early + calls
            if calls and reason == "stop":
                reason = "tool_calls"
            message = ChatMessageOut(
                content=content or None,
                tool_calls=[
                    ToolCallOut(
                        id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)
                    )
                    for c in calls
                ]
                or None,
                **shown,
            )
        return ChatChoice(
            index=i,
            message=message,
            logprobs=_chat_logprobs(got.entries(i)) if self.logprobs else None,
            finish_reason=reason,
        )
