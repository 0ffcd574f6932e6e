"""How many intra-op threads a prefill batch gets (`TPLA_PREFILL_THREADS`, default 1).

Every process of the local stack runs on `torch_threads` (1 by default) because several of
them share a few cores. A prefill worker with cores of its own (a prefill pod) should use
them for long prompts: a long prefill is the largest single computation of a request, and
one thread bounds a long-prompt workload's throughput. Batches of at least `min_tokens`
tokens then run on `large` threads; small ones stay on `torch_threads` (their parallel
regions are too short to gain).

Why the default is 1, measured on the 2-core VM where the prefill worker shares the cores
with both decode ranks (`benchmarks/serve.md`, "HF on both cores, and `TPLA_PREFILL_THREADS`"):
2 threads for large batches raised long-prompt throughput at 16 streams (68-71 vs 51-59
output tokens/s) but cut short-prompt throughput (268-275 vs 285-328 tokens/s; time to first
token p50 ~1.0 s instead of 0.54-0.59 s). The likely cause, not measured directly: a burst of
64-token prompts is prefilled as one batch of >= 512 tokens while the first requests already
decode, and with more runnable threads than cores the two OpenMP threads wait for each other.
With sleeping waits (`OMP_WAIT_POLICY=PASSIVE`, which `tpla serve` sets when this exceeds
torch_threads) the short-prompt loss shrank to 2-7% and the long-prompt gain stayed. With
prefill batches capped at 2,048 tokens, three alternations measured neither gain nor loss for
the disaggregated stack (the two threads compete with both decode ranks).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from common.runtime.settings import Settings

# Batches of at least this many tokens get the larger thread count.
PARALLEL_MIN_TOKENS = 512


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class PrefillThreads:
    base: int  # torch_threads: small batches and everything else in the process
    large: int  # batches of >= min_tokens tokens
    min_tokens: int = PARALLEL_MIN_TOKENS

    def __post_init__(self) -> None:
        if self.base < 1 or self.large < 1 or self.min_tokens < 1:
            raise ValueError(f"thread counts and min_tokens must be >= 1, got {self}")

    @classmethod
    def from_settings(cls, s: Settings) -> PrefillThreads:
        return cls.of(s.torch_threads, s.prefill_threads)

    @classmethod
    def of(cls, torch_threads: int, prefill_threads: int) -> PrefillThreads:
        """`prefill_threads`, but never fewer than `torch_threads` and never more than the
        usable cores (more threads than cores make OpenMP threads wait for each other)."""
        return cls(torch_threads, max(torch_threads, min(prefill_threads, usable_cores())))

    def for_tokens(self, tokens: int) -> int:
        return self.large if tokens >= self.min_tokens else self.base

    @contextmanager
    def applied(self, tokens: int) -> Iterator[int]:
        """Run a prefill of `tokens` tokens with its thread count, then restore the caller's
        (the colocated engine runs decode steps on the same thread)."""
        before = torch.get_num_threads()
        want = self.for_tokens(tokens)
        if want != before:
            torch.set_num_threads(want)
        try:
            yield want
        finally:
            if want != before:
                torch.set_num_threads(before)
