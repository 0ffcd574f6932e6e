"""What a traced prefill job's spans are made of, measured by the worker as the job goes.

The worker (worker.py) knows no tracing: for a job that carries a `JobTrace` it writes down
its batch's times and sizes and each decode rank's push; once the job is done, `record`
turns them into spans under the servicer's. A job without one (tracing off) costs nothing
extra. Times are nanoseconds since the epoch, the spans' clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry.trace import Span

from common.runtime.spans import Spans, end


@dataclass
class RankPush:
    """One decode rank's shard on its way: written by the pusher thread that sends it."""

    rank: int
    address: str
    start_ns: int = 0
    end_ns: int = 0
    sent_bytes: int = 0
    error: str = ""


@dataclass
class JobTrace:
    batch_start_ns: int = 0
    batch_end_ns: int = 0
    batch_jobs: int = 0
    batch_tokens: int = 0  # computed for the whole batch
    computed_tokens: int = 0  # this job's prompt tokens run through the model
    reused_tokens: int = 0  # this job's prefix from the latent prefix cache
    pushes: list[RankPush] = field(default_factory=list)

    def batched(
        self, start_ns: int, seconds: float, jobs: int, tokens: int, computed: int, reused: int
    ) -> None:
        """The job's batch: when it started, how long the prefill took, its size, and how
        many of this job's tokens were computed or reused from the prefix cache. A prompt
        prefilled in chunks calls it once per chunk: the span runs from its first chunk's
        batch to its last one's, with every chunk's tokens (size: the last batch's)."""
        if not self.batch_start_ns:
            self.batch_start_ns, self.computed_tokens = start_ns, 0
        self.batch_end_ns = start_ns + int(seconds * 1e9)
        self.batch_jobs, self.batch_tokens = jobs, tokens
        self.computed_tokens += computed
        self.reused_tokens = reused

    def timed(self, rank: int, address: str, send: Callable[..., int]) -> Callable[..., int]:
        """`send` (a KvSender's, returning bytes sent) recording one rank's push here."""
        push = RankPush(rank, address)
        self.pushes.append(push)

        def run(*args: object) -> int:
            push.start_ns = time.time_ns()
            try:
                push.sent_bytes = send(*args)
                return push.sent_bytes
            except BaseException as exc:
                push.error = str(exc) or type(exc).__name__
                raise
            finally:
                push.end_ns = time.time_ns()

        return run

    def record(self, spans: Spans, parent: Span | None) -> None:
        """`prefill.batch` and one `kv.transfer` per decode rank, under `parent`; parts the
        job never reached (it failed before them) are left out."""
        if self.batch_end_ns:
            attributes = {
                "tpla.batch_jobs": self.batch_jobs,
                "tpla.batch_tokens": self.batch_tokens,
                "tpla.computed_tokens": self.computed_tokens,
                "tpla.cached_tokens": self.reused_tokens,
            }
            spans.interval(
                "prefill.batch", parent, self.batch_start_ns, self.batch_end_ns, attributes
            )
        for push in self.pushes:
            if not push.start_ns:
                continue
            span = spans.start(
                "kv.transfer",
                parent,
                {"tpla.rank": push.rank, "tpla.address": push.address},
                start_ns=push.start_ns,
            )
            failed = RuntimeError(push.error) if push.error else None
            seconds = (push.end_ns - push.start_ns) / 1e9 if push.end_ns else 0.0
            done = {"tpla.bytes": push.sent_bytes, "tpla.seconds": seconds}
            end(span, done, error=failed, end_ns=push.end_ns or None)
