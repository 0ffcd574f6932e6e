"""The in-process messages between services: one frozen dataclass per message.

A reservation travels from the decode group's Reserve through the router to the prefill
worker as one `Reservation` (a `KvTargetInfo` per rank); the prefill worker cuts one
`common.kv.transfer.Shard` per target, and its outcome is a `PrefillResult`. The decode group
streams `TokenEvent`s (a migrated n > 1 request's choices resume as `ResumedChoice`s) and
reports its `DecodeLoad`. common/rpc/proto_mapping.py maps each to and from its protobuf message.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.sampling.sampler import SampledToken

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class KvTargetInfo:
    """Where one decode rank receives its shard of a request, and which part it caches."""

    rank: int
    grpc_address: str
    torch_address: str
    latent_start: int
    latent_width: int
    block_ids: tuple[int, ...]
    token_ranges: tuple[int, ...] = ()
    # The reservation's epoch: its pushes carry it; a rank drops one whose blocks were given
    # out again since (common/kv/epochs.py). 0: unfenced (a shard sent outside a reservation).
    epoch: int = 0


@dataclass(frozen=True)
class Reservation:
    """A request's reserved KV on a decode group: the cache's shape and each rank's target."""

    request_id: str
    block_size: int
    num_layers: int
    rope_width: int
    dtype: str
    lease_seconds: float
    targets: tuple[KvTargetInfo, ...]
    cached_tokens: int = 0  # leading prompt tokens the group holds already: not shipped

    @property
    def epoch(self) -> int:
        """The reservation's epoch, which each target's pushes carry."""
        return self.targets[0].epoch if self.targets else 0


@dataclass(frozen=True)
class PrefillResult:
    first_token: SampledToken  # choice 0's
    prefill_seconds: float
    transfer_seconds: float
    transfer_bytes: int
    cached_tokens: int = 0  # leading prompt tokens the prefill reused from its own cache
    choice_tokens: tuple[SampledToken, ...] = ()  # n > 1: every choice's first token, in order
    # Prompt tokens 1..N-1 (the first has no context to be predicted from), when asked for.
    prompt_logprobs: tuple[SampledToken, ...] = ()
    # From the end of the last chunk's compute to the last rank's ack: what TTFT waits for.
    exposed_transfer_seconds: float = 0.0
    # The prompt's last hidden state (before the final norm) where the decode group runs MTP
    # drafts: its first step drafts from it.
    hidden: tuple[float, ...] = ()

    @property
    def first_tokens(self) -> tuple[SampledToken, ...]:
        """One first token per choice."""
        return self.choice_tokens or (self.first_token,)


@dataclass(frozen=True)
class ResumedChoice:
    """A live choice of a migrated n > 1 request, as its new group continues it: its index
    in the request, and the tokens it generated after its first token on the group it left
    (the new group replays them before the choice samples again)."""

    index: int
    replay: tuple[int, ...] = ()


class FailureScope(enum.Enum):
    """Whose failure ended a choice with an error, which decides what the router does."""

    # The request's own (its grammar cannot go on, a deterministic error): it would fail the
    # same on any group, so it ends there; the group is not blamed.
    REQUEST = "request"
    # The group's (a rank died, a collective or a step timed out, the engine stopped): the
    # router quarantines the group and may move the request to another.
    GROUP = "group"


@dataclass(frozen=True)
class TokenEvent:
    """One event of a request's stream; the last one carries the finish_reason."""

    token: SampledToken | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error: ..."
    logits: Tensor | None = None  # in process only (tests compare them); never on the wire
    index: int = 0  # the choice (n > 1); a request's stream ends after every choice's last
    # The drafts a speculative step fed the choice, and how many it kept: on the first event
    # of that step's tokens (a choice's totals are the sums over its events).
    drafted: int = 0
    accepted: int = 0
    failure: FailureScope | None = None  # set with an "error: ..." finish_reason

    @classmethod
    def failed(cls, scope: FailureScope, message: str, index: int = 0) -> TokenEvent:
        """A choice's end by an error (no token: nothing sampled with it is sent)."""
        return cls(None, f"error: {message}", index=index, failure=scope)


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
