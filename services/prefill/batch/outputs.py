"""What a prefill job answers with besides its KV (`FirstTokens`): from its prompt's logits,
and the last hidden state a decode group's MTP drafts start from."""

from __future__ import annotations

from dataclasses import dataclass

from common.model.causal_lm import PrefillOutput
from common.sampling.sampler import SampledToken


@dataclass(frozen=True)
class FirstTokens:
    """What a job samples from its prefill: each choice's first token, and the logprobs of
    prompt tokens 1..N-1 when asked for (the first has nothing to be predicted from)."""

    tokens: tuple[SampledToken, ...]
    prompt_logprobs: tuple[SampledToken, ...] = ()
    hidden: tuple[float, ...] = ()  # the last position's hidden state, for MTP drafts


def last_hidden(out: PrefillOutput, end: int) -> tuple[float, ...]:
    """Row end - 1's hidden state before the final norm: a prompt's last position."""
    assert out.hidden is not None
    return tuple(out.hidden[end - 1].float().tolist())
