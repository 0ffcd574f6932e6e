"""One live choice of a request on the leader, from its first token until it ends: what it
samples with and the events it sends."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from torch import Tensor

from common.messages import FailureScope, TokenEvent
from common.sampling.params import SamplingParams
from common.sampling.sampler import SampledToken
from services.decode.leader.controls import SequenceControls
from services.decode.leader.drafts import Proposer
from services.decode.stream import TokenStream


@dataclass
class LiveChoice:
    """One choice of a request, from its first token until it ends."""

    params: SamplingParams
    stream: TokenStream
    seed: int  # its draws' key with (choice, position): the request's seed or one drawn
    controls: SequenceControls
    choice: int = 0  # its index in the request (a resumed choice's need not be its fork's)
    # A resumed choice's own earlier tokens, still to be fed in place of its samples.
    replay: deque[int] = field(default_factory=deque)
    drafts: Proposer | None = None  # its draft proposer (speculative decoding on)

    def event(
        self,
        token: SampledToken | None,
        reason: str | None,
        logits: Tensor | None = None,
        spec: tuple[int, int] = (0, 0),
    ) -> TokenEvent:
        """Its event for `token`. A choice whose grammar failed ends without the token, which
        the grammar did not allow (it is never sent), as the request's own failure. Only the
        event that ends it (`reason`) is that failure: the kept drafts before it in the same
        step were allowed, and go out as tokens (the controls have already seen the run)."""
        if reason is not None and self.controls.failed:
            return TokenEvent.failed(FailureScope.REQUEST, self.controls.failure, self.choice)
        return TokenEvent(token, reason, logits, self.choice, *spec)
