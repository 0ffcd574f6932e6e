"""A performance profile: what one prefill worker and one decode group do, as measured by
`tpla bench serve --profile`. Prefill throughput by prompt length; decode inter-token
latency by batch and context. Lookups interpolate linearly between measured points and hold
the edge value beyond them (never extrapolate a trend past what was measured); a decode batch
larger than the largest measured one has no latency (the group was never seen to hold it)."""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through sorted `xs`, clamped to the end values."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    hi = bisect.bisect_right(xs, x)
    lo = hi - 1
    t = (x - xs[lo]) / (xs[hi] - xs[lo])
    return ys[lo] + t * (ys[hi] - ys[lo])


def _increasing(values: Sequence[float], what: str) -> None:
    if not values or any(b <= a for a, b in itertools.pairwise(values)):
        raise ValueError(f"profile {what} must be non-empty and strictly increasing: {values}")


@dataclass(frozen=True)
class PrefillProfile:
    """One prefill worker: prompt tokens per second at each measured prompt length."""

    gpus: int
    prompt_tokens: tuple[int, ...]
    tokens_per_s: tuple[float, ...]

    def __post_init__(self) -> None:
        _increasing(self.prompt_tokens, "prefill prompt lengths")
        if len(self.tokens_per_s) != len(self.prompt_tokens) or min(self.tokens_per_s) <= 0:
            raise ValueError("one positive tokens/s per prefill prompt length")
        if self.gpus < 1:
            raise ValueError("a prefill worker holds at least one GPU")

    def throughput(self, prompt_tokens: float) -> float:
        """Prompt tokens per second of one worker at this prompt length."""
        return _interp(self.prompt_tokens, self.tokens_per_s, prompt_tokens)

    def service_s(self, prompt_tokens: float) -> float:
        """Seconds one worker spends prefilling one prompt of this length."""
        return prompt_tokens / self.throughput(prompt_tokens)


@dataclass(frozen=True)
class DecodeProfile:
    """One decode group: `itl_s[i][j]` is the inter-token latency at `batches[i]` running
    sequences of `contexts[j]` tokens each."""

    gpus: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    itl_s: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        _increasing(self.batches, "decode batches")
        _increasing(self.contexts, "decode contexts")
        shape_ok = len(self.itl_s) == len(self.batches) and all(
            len(row) == len(self.contexts) for row in self.itl_s
        )
        if not shape_ok or min(min(row) for row in self.itl_s) <= 0:
            raise ValueError("decode itl_s: one positive latency per (batch, context)")
        if self.gpus < 1:
            raise ValueError("a decode group holds at least one GPU")

    @property
    def max_batch(self) -> int:
        return self.batches[-1]

    def itl(self, batch: float, context: float) -> float:
        """Seconds per token of each sequence at this batch (clamped below to the smallest
        measured) and context. Raises for a batch beyond the largest measured one."""
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} beyond the profile's largest, {self.max_batch}")
        by_batch = [_interp(self.contexts, row, context) for row in self.itl_s]
        return _interp(self.batches, by_batch, batch)

    def tokens_per_s(self, batch: float, context: float) -> float:
        """Output tokens per second of the whole group at this batch and context."""
        return batch / self.itl(batch, context)


@dataclass(frozen=True)
class PerformanceProfile:
    model: str
    source: str  # what measured it: the bench command, the machine
    prefill: PrefillProfile
    decode: DecodeProfile

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "source": self.source,
            "prefill": {
                "gpus": self.prefill.gpus,
                "prompt_tokens": list(self.prefill.prompt_tokens),
                "tokens_per_s": list(self.prefill.tokens_per_s),
            },
            "decode": {
                "gpus": self.decode.gpus,
                "batches": list(self.decode.batches),
                "contexts": list(self.decode.contexts),
                "itl_s": [list(row) for row in self.decode.itl_s],
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PerformanceProfile:
        try:
            p, d = data["prefill"], data["decode"]
            return cls(
                model=str(data.get("model", "")),
                source=str(data.get("source", "")),
                prefill=PrefillProfile(
                    int(p["gpus"]),
                    tuple(int(x) for x in p["prompt_tokens"]),
                    tuple(float(x) for x in p["tokens_per_s"]),
                ),
                decode=DecodeProfile(
                    int(d["gpus"]),
                    tuple(int(x) for x in d["batches"]),
                    tuple(int(x) for x in d["contexts"]),
                    tuple(tuple(float(x) for x in row) for row in d["itl_s"]),
                ),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a performance profile: missing or malformed {exc}") from exc


def load_profile(path: str | Path) -> PerformanceProfile:
    return PerformanceProfile.from_dict(json.loads(Path(path).read_text()))


def save_profile(profile: PerformanceProfile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
