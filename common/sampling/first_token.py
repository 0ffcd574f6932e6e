"""A prompt's first tokens, sampled where its prefill ran: one rule for a prefill worker and a
decode group that prefills the prompt itself (services/decode/leader/local_prefill.py).

Every choice's first token is processed as each later token is at decode (penalties over the
request's earlier output, its grammar, its thinking: common/sampling/thinking.py), drawn
with the key of the prompt's length (`first_tokens`). The choices share the prompt and the
history before their first token, so their rows agree, the allowed tokens too: one matcher's,
after the thinking the request did before.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from torch import Tensor

from common.sampling.grammar import GrammarMatcher
from common.sampling.logits import context_for
from common.sampling.params import SamplingParams
from common.sampling.sampler import SampledToken, first_tokens
from common.sampling.thinking import Thinking, allowed_first


def sample_first(
    logits: Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    num_output_tokens: int,
    matcher: GrammarMatcher | None,
    n: int,
    eos_token_ids: Collection[int],
) -> tuple[SampledToken, ...]:
    """Each of n choices' first token from the prompt's last position's logits [V]. The last
    `num_output_tokens` of `prompt_ids` are the request's own earlier output (a migrated
    request); `matcher` is its grammar past the answer in them."""
    vocab, device = logits.shape[-1], logits.device
    split = len(prompt_ids) - num_output_tokens
    prompt, outputs = prompt_ids[:split], prompt_ids[split:]
    thinking = Thinking.start(params, outputs) if params.tracks_thinking else None
    allowed = allowed_first(thinking, matcher, vocab, device)
    if allowed is not None:
        allowed = allowed.expand(n, -1)
    context = context_for(
        [params] * n, [prompt] * n, [outputs] * n, eos_token_ids, vocab, device, allowed
    )
    return first_tokens(logits, params, n, context, position=len(prompt_ids))
