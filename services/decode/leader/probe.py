"""What benchmarks, metrics and tests observe of a decode group's steps: one `StepProbe`.

The step and the loop write it on the loop thread; observers read it there (`on_step`,
`Acceptance.on_verify`) or between steps. Its switches (`count_syncs`, `on_step`) may be set
from any thread: a step reads `count_syncs` once, at its start, so a switch takes effect
from the next step on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Acceptance:
    """The group's speculative-decoding counts: drafts fed, drafts kept, and each
    verification's kept length (what the metrics export: services/decode/server/metrics.py)."""

    drafted: int = 0
    accepted: int = 0
    # Called on the loop thread with each sequence-step's kept drafts (of those it was fed).
    on_verify: Callable[[int], None] | None = None

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        if self.on_verify is not None:
            self.on_verify(accepted)


@dataclass
class StepProbe:
    """The step's hooks: its seconds, its host waits when counted, the drafts kept, and
    each token's logits when kept."""

    # Each token event carries its row's logits (tests, eval: EngineConfig.record_logits).
    record_logits: bool = False
    # `tpla bench decode-step`: count each step's host waits on every rank (it slows the
    # step); `last_host_syncs`, the most on any rank of the last counted step, the
    # leader's sampling included.
    count_syncs: bool = False
    last_host_syncs: int = 0
    # Recent step times (metrics); bounded so the loop never grows or copies it.
    step_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=100))
    # Called with each step's seconds and batch size on the loop thread (the service's
    # histogram, `tpla bench decode-step`).
    on_step: Callable[[float, int], None] | None = None
    acceptance: Acceptance = field(default_factory=Acceptance)

    def stepped(self, seconds: float, batch: int) -> None:
        """A step of `batch` sequences took `seconds`."""
        self.step_seconds.append(seconds)
        if self.on_step is not None:
            self.on_step(seconds, batch)
