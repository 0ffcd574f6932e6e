"""The router's in-process request and output types (no pydantic, no I/O).

`prepare.py` builds a `GenerationRequest` from an OpenAI body (one per prompt of a batch);
`Pipeline.run` yields `Started`, then (with echo) `Prompt`, then every choice's `Delta`s, each
choice's `ChoiceEnd` as it ends, then `Done`; `chat_format.py` and `completion_format.py` turn
those into OpenAI bodies.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.sampling.params import SamplingParams
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
    n: int = 1  # choices, forked from one prefill
    echo_text: str | None = None  # completions with echo: the prompt as the client sees it
    prompt_logprobs: int | None = None  # echo with logprobs: alternatives per prompt token
    # echo with max_tokens 0: prefill and score the prompt, generate nothing (params and the
    # reservation still say 1 token, which is never decoded)
    score_only: bool = False
    tools: ToolCalling | None = None  # the output is parsed for tool calls
    keep_special_tokens: bool = False  # in the text (a model's tool-call or think markers)
    # A reasoning model's request that starts by thinking (reasoning.py): its output is
    # reasoning until </think>; params.think_end_ids says the same to the workers.
    thinking: bool = False


@dataclass(frozen=True)
class Started:
    request_id: str


@dataclass(frozen=True)
class Prompt:
    """The echoed prompt (completions with echo), before any Delta: its text and, when
    logprobs were asked for, its tokens' logprobs (the first token's is None)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Delta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    index: int = 0  # the choice


@dataclass(frozen=True)
class ChoiceEnd:
    index: int
    finish_reason: str  # "stop" | "length"


@dataclass(frozen=True)
class Done:
    finish_reasons: tuple[str, ...]  # per choice
    prompt_tokens: int  # the prompt once, whatever n
    completion_tokens: int  # every choice's
    # Prompt tokens not recomputed: the longest cached prefix the prefill worker or the
    # decode group held (whichever reused more).
    cached_tokens: int = 0
    reasoning_tokens: int | None = None  # every choice's thinking (None: it did not think)


Output = Started | Prompt | Delta | ChoiceEnd | Done
