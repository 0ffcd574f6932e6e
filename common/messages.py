"""What a decode group hands its callers, in process: token events and its load.

One type per message, shared by the engine, its gRPC servicer, the local driver and the
router's client (common/rpc/convert.py maps them to and from the wire).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.sampling.sampler import SampledToken

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class TokenEvent:
    """One event of a request's stream; the last one carries the finish_reason."""

    token: SampledToken | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error: ..."
    logits: Tensor | None = None  # in process only (tests compare them); never on the wire
    index: int = 0  # the choice (n > 1); a request's stream ends after every choice's last


@dataclass(frozen=True)
class DecodeLoad:
    """A decode group's load. The engine fills the counts; the servicer adds the group's
    layout (tp, latent groups, parallel mode) before it goes on the wire."""

    running: int
    waiting: int
    reserved: int
    blocks_used: int
    blocks_total: int
    block_size: int
    tp: int = 1
    latent_groups: int = 1
    parallel: str = ""
    blocks_cached: int = 0  # cached prefix blocks no live request holds (evictable)
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, tokens found cached

    @property
    def usage_ratio(self) -> float:
        return self.blocks_used / max(self.blocks_total, 1)
