"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, top-k logprobs.

Pure tensor math shared by `tpla generate` and the decode engine's leader. Each request owns
a `torch.Generator` seeded from its seed, so a seeded request reproduces its tokens no matter
which other requests share its batch.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import Tensor


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

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


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


def make_generator(
    params: SamplingParams, device: torch.device | str = "cpu", stream: int = 0
) -> torch.Generator:
    """A request's generator. `stream` separates the draws of different stages (the prefill
    worker samples the first token with stream 0, the decode leader the rest with stream 1)
    so a seeded request never reuses a random draw."""
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        # Mixed into torch's 64-bit seed space: any int64 seed is valid, none overflows.
        gen.manual_seed((params.seed * 1_000_003 + stream) % 2**64)
    return gen


def filtered_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Apply temperature, top-k and top-p to one row of logits [V] (float32)."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token once the mass before it already reaches top_p; the top token always stays.
        drop = (cum - sorted_logits.softmax(-1)) >= params.top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator) -> SampledToken:
    """Pick the next token from one row of logits [V]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    if params.greedy:
        token = int(logits.argmax())
    else:
        probs = filtered_logits(logits, params).softmax(-1)
        token = int(torch.multinomial(probs, 1, generator=generator))
    top: tuple[tuple[int, float], ...] = ()
    if params.logprobs:
        values, ids = logprobs.topk(params.logprobs)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return SampledToken(token, float(logprobs[token]), top)
