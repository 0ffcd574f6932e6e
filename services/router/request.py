"""The router's in-process request and output types (no pydantic, no I/O).

`prepare.py` builds a `GenerationRequest` from an OpenAI body; `Pipeline.run` yields
`Started`, then `Delta`s, then `Done`; `responses.py` turns those into OpenAI bodies.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.sampling import SamplingParams
from services.router.text import TokenLogprob
from services.router.tools import ToolCalling


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str  # chatcmpl-<hex> / cmpl-<hex>: the same id in Redis and on gRPC
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stops: tuple[str, ...]
    stream: bool
    want_logprobs: bool
    arrival: float  # time.monotonic() when the HTTP request arrived
    prompt_text: str = ""  # only for logging, and only when log_prompts is on
    tools: ToolCalling | None = None  # the output is parsed for tool calls
    keep_special_tokens: bool = False  # in the text (a model's tool-call markers)


@dataclass(frozen=True)
class Started:
    request_id: str


@dataclass(frozen=True)
class Delta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens not recomputed: the longest cached prefix the prefill worker or the
    # decode group held (whichever reused more).
    cached_tokens: int = 0


Output = Started | Delta | Done
