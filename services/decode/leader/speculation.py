"""The group's speculative-decoding counts: drafts fed, drafts kept, and each verification's
kept length (what the metrics export: services/decode/server/metrics.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Acceptance:
    drafted: int = 0
    accepted: int = 0
    # Called on the loop thread with each sequence-step's kept drafts (of those it was fed).
    on_verify: Callable[[int], None] | None = None

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        if self.on_verify is not None:
            self.on_verify(accepted)
