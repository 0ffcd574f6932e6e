"""Pipeline outputs -> OpenAI text completion bodies and SSE chunks.

Streaming: one chunk per Delta, a chunk with the finish_reason as each choice ends and an
optional usage chunk; the route then sends `data: [DONE]`. A batch of prompts: prompt k's
choice j is choice k * n + j. With echo, each choice starts with its prompt (and, with
logprobs, the prompt's logprobs, the first token's null).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.router.body_parts import Choices, sse, total_usage
from services.router.request import ChoiceEnd, Delta, Done, Output, Prompt
from services.router.response_schemas import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
)
from services.router.text import TokenLogprob


def _completion_logprobs(entries: Sequence[TokenLogprob], offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for e in entries:
        out.tokens.append(e.token)
        out.token_logprobs.append(e.logprob)
        # OpenAI: the echoed prompt's first token has null for both.
        out.top_logprobs.append(dict(e.top) if e.logprob is not None else None)
        out.text_offset.append(offset)
        offset += len(e.token)
    return out


class CompletionFormat:
    def __init__(
        self, request_id: str, model: str, logprobs: bool, include_usage: bool, n: int = 1
    ) -> None:
        self.id, self.model = request_id, model
        self.logprobs, self.include_usage, self.n = logprobs, include_usage, n
        self._offsets: dict[int, int] = {}  # streaming: text sent so far, per choice

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return sse(CompletionResponse(id=self.id, model=self.model, choices=choices, usage=usage))

    def opening(self) -> list[str]:
        return []

    def event(self, run: int, out: Output) -> list[str]:
        """The SSE lines of one output of prompt `run` of the batch."""
        if isinstance(out, Prompt):  # echo: every choice of this prompt starts with it
            lp = _completion_logprobs(out.logprobs, 0) if self.logprobs else None
            lines = []
            for j in range(self.n):
                self._offsets[run * self.n + j] = len(out.text)
                choice = CompletionChoice(index=run * self.n + j, text=out.text, logprobs=lp)
                lines.append(self._chunk([choice]))
            return lines
        if isinstance(out, Delta):
            index = run * self.n + out.index
            offset = self._offsets.get(index, 0)
            lp = _completion_logprobs(out.logprobs, offset) if self.logprobs else None
            self._offsets[index] = offset + len(out.text)
            return [self._chunk([CompletionChoice(index=index, text=out.text, logprobs=lp)])]
        if isinstance(out, ChoiceEnd):
            index = run * self.n + out.index
            end = CompletionChoice(index=index, text="", finish_reason=out.finish_reason)
            return [self._chunk([end])]
        return []

    def closing(self, dones: Sequence[Done]) -> list[str]:
        return [self._chunk([], usage=total_usage(dones))] if self.include_usage else []

    def full(self, runs: Sequence[Sequence[Output]]) -> CompletionResponse:
        got = Choices(runs, self.n)
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
                CompletionChoice(
                    index=i,
                    text=head + got.text(i),
                    logprobs=logprobs,
                    finish_reason=got.reasons[i],
                )
            )
        return CompletionResponse(
            id=self.id, model=self.model, choices=choices, usage=total_usage(got.dones)
        )
