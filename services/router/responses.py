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

import json
from collections.abc import Sequence

from pydantic import BaseModel

from common.errors import TplaError
from services.router import schemas as s
from services.router.request import ChoiceEnd, Delta, Done, Output, Prompt
from services.router.text import TokenLogprob

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
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
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


class ChatFormat:
    def __init__(
        self, request_id: str, model: str, logprobs: bool, include_usage: bool, n: int = 1
    ) -> None:
        self.id, self.model = request_id, model
        self.logprobs, self.include_usage, self.n = logprobs, include_usage, n

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
            lp = _chat_logprobs(out.logprobs) if self.logprobs else None
            delta = s.ChatDelta(content=out.text)
            return [self._chunk([s.ChatChunkChoice(index=out.index, delta=delta, logprobs=lp)])]
        if isinstance(out, ChoiceEnd):
            end = s.ChatChunkChoice(
                index=out.index, delta=s.ChatDelta(), finish_reason=out.finish_reason
            )
            return [self._chunk([end])]
        return []

    def closing(self, dones: Sequence[Done]) -> list[str]:
        return [self._chunk([], usage=_usage(dones))] if self.include_usage else []

    def full(self, runs: Sequence[Sequence[Output]]) -> s.ChatCompletionResponse:
        got = _Choices(runs, self.n)
        return s.ChatCompletionResponse(
            id=self.id,
            model=self.model,
            choices=[
                s.ChatChoice(
                    index=i,
                    message=s.ChatMessageOut(content=got.text(i)),
                    logprobs=_chat_logprobs(got.entries(i)) if self.logprobs else None,
                    finish_reason=got.reasons[i],
                )
                for i in got.indices()
            ],
            usage=_usage(got.dones),
        )


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
