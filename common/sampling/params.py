"""A request's sampling parameters, checked when they are made: the one shape that the router
builds, gRPC carries, and every sampler and logits processor reads.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from common.sampling.grammar import GrammarSpec


class SamplingError(ValueError):
    """Sampling parameters out of range."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int = 0  # number of top alternatives to report per token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off; over the prompt and the output (vLLM)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_tokens: int = 0  # stop tokens are forbidden until this many tokens are generated
    min_p: float = 0.0  # 0 = off
    grammar: GrammarSpec | None = None  # structured output: what the text must match
    # A reasoning request's thinking (common/sampling/thinking.py): set, the sequence thinks
    # from its first token until it samples one of these; the grammar applies after it.
    think_end_ids: tuple[int, ...] = ()
    # At most this many thinking tokens, then a think-end token is forced (None: no limit).
    thinking_budget: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise SamplingError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.logprobs <= 20:
            raise SamplingError(f"logprobs must be in [0, 20], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise SamplingError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"
            )
        if any(not -100.0 <= v <= 100.0 for _, v in self.logit_bias):
            raise SamplingError("logit_bias values must be in [-100, 100]")
        if any(t < 0 for t, _ in self.logit_bias):
            raise SamplingError("logit_bias token ids must be >= 0")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingError(f"min_p must be in [0, 1], got {self.min_p}")
        if any(t < 0 for t in self.think_end_ids):
            raise SamplingError("think_end_ids must be >= 0")
        if self.thinking_budget is not None and (
            self.thinking_budget < 0 or not self.think_end_ids
        ):
            raise SamplingError("thinking_budget must be >= 0 and needs think_end_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether sampling needs the sequence's own history (a penalty is on)."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def processed(self) -> bool:
        """Whether any logits processing applies (see common.sampling.logits)."""
        return (
            self.penalized
            or bool(self.logit_bias or self.min_tokens)
            or self.grammar is not None
            or self.thinking_budget is not None
        )

    @property
    def tracks_thinking(self) -> bool:
        """Whether sampling follows the sequence's thinking: it thinks, and a grammar waits
        for its end or a budget ends it (plain thinking needs no state where it samples)."""
        return bool(self.think_end_ids) and (
            self.grammar is not None or self.thinking_budget is not None
        )

    def stop_ids(self, eos_ids: Collection[int]) -> frozenset[int]:
        """The tokens that end the request: stop ids, and EOS unless ignored."""
        return frozenset(self.stop_token_ids) | (
            frozenset() if self.ignore_eos else frozenset(eos_ids)
        )

    def is_stop(self, token_id: int, eos_ids: Collection[int]) -> bool:
        """Whether generating `token_id` ends the request (stop ids, or EOS unless ignored)."""
        return token_id in self.stop_token_ids or (not self.ignore_eos and token_id in eos_ids)

    def finish_reason(
        self, token_id: int, generated: int, eos_ids: Collection[int], limit: int | None = None
    ) -> str | None:
        """Why `token_id`, the request's `generated`-th token, ends it: "stop", "length" at
        `limit` tokens (default max_tokens), or None when generation goes on."""
        if self.is_stop(token_id, eos_ids):
            return "stop"
        return "length" if generated >= (self.max_tokens if limit is None else limit) else None
