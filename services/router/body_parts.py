"""What every OpenAI response of the router shares: SSE lines, usage, and each choice's
outputs gathered for a non-streaming body. The bodies themselves are built per endpoint:
chat_format.py and completion_format.py.

A completions request with a batch of prompts is one pipeline run per prompt; run k's choice
j is choice k * n + j of the response (OpenAI's order), and usage sums the runs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from pydantic import BaseModel

from common.runtime.errors import TplaError
from services.router.request import ChoiceEnd, Delta, Done, Output, Prompt
from services.router.response_schemas import CompletionTokensDetails, PromptTokensDetails, Usage
from services.router.text import TokenLogprob

DONE_LINE = "data: [DONE]\n\n"
# Line breaks to Python's str.splitlines (and so to httpx's iter_lines, which the OpenAI-style
# clients read streams with) that JSON leaves raw: a token holding one would cut its event in
# two. Escaped, the JSON means the same text.
_RAW_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(body: BaseModel | dict[str, object]) -> str:
    payload = body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body)
    return f"data: {payload.translate(_RAW_LINE_BREAKS)}\n\n"


def sse_error(error: TplaError) -> str:
    """A failure after the stream started: the headers (200) are gone, so say it in-band."""
    return sse(error.openai_body())


def total_usage(dones: Sequence[Done]) -> Usage:
    prompt = sum(d.prompt_tokens for d in dones)
    completion = sum(d.completion_tokens for d in dones)
    thought = [d.reasoning_tokens for d in dones if d.reasoning_tokens is not None]
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(d.cached_tokens for d in dones)
        ),
        completion_tokens_details=(
            CompletionTokensDetails(reasoning_tokens=sum(thought)) if thought else None
        ),
    )


class Choices:
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
