"""How often an MTP layer's greedy draft is what greedy speculation accepts, on held-out text.

Each held-out window's first `prompt` tokens are continued greedily by the main model for
`new` tokens. On that sequence, position t's draft (the MTP layer fed the main model's
hidden state at t and its token t+1) is accepted when it equals the main model's greedy
token at t+2, counted over the positions where t+1 is a generated token: exactly the first
draft of greedy speculation after every token. The main model's greedy tokens come from one
teacher-forced pass over the whole sequence, so decode numerics cannot move them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from common.model.causal_lm import DeepseekForCausalLM
from common.model.contiguous_cache import ContiguousLatentCache
from common.model.mtp import MTPLayer, mtp_prefill


@dataclass(frozen=True)
class Acceptance:
    accepted: int
    drafted: int
    windows: int

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def greedy_continuation(model: DeepseekForCausalLM, prompt: Tensor, new: int) -> Tensor:
    """`prompt` [P] followed by `new` greedy tokens (prefill, then absorbed decode)."""
    out = model.prefill(prompt, [len(prompt)])
    dtype = model.lm_head.weight.dtype
    cache = ContiguousLatentCache(model.config, 1, len(prompt) + new, dtype, prompt.device)
    cache.load_prefill(0, out, 0, len(prompt))
    seq = prompt.tolist()
    logits = out.logits[0]
    for _ in range(new):
        seq.append(int(logits.argmax()))
        if len(seq) == len(prompt) + new:
            break
        pos = torch.tensor([len(seq) - 1], device=prompt.device)
        logits = model.decode(torch.tensor([seq[-1]], device=prompt.device), pos, cache)[0]
    return torch.tensor(seq, dtype=torch.long, device=prompt.device)


@torch.inference_mode()
def sequence_acceptance(
    model: DeepseekForCausalLM, mtp: MTPLayer, seq: Tensor, prompt: int
) -> tuple[int, int]:
    """(accepted, drafted) over a sequence whose tokens after `prompt` are the model's."""
    main = model.prefill(seq, [len(seq)], all_logits=True)
    assert main.hidden is not None
    greedy = main.logits.argmax(-1)  # greedy[t]: the main model's token t+1
    draft = mtp_prefill(mtp, model.rope, seq[1:], main.hidden[:-1], [len(seq) - 1], all_logits=True)
    drafts = draft.logits.argmax(-1)  # drafts[t]: the MTP layer's token t+2
    rows = torch.arange(max(prompt - 1, 0), len(seq) - 1, device=seq.device)
    accepted = int((drafts[rows] == greedy[rows + 1]).sum())
    return accepted, int(rows.numel())


def measure_acceptance(
    model: DeepseekForCausalLM,
    mtp: MTPLayer,
    ids: Tensor,
    *,
    windows: int = 16,
    prompt: int = 64,
    new: int = 64,
) -> Acceptance:
    """Greedy-speculation acceptance over `windows` evenly spaced windows of `ids`."""
    span = prompt
    if len(ids) < span + 1:
        raise ValueError("the held-out text is shorter than one prompt")
    step = max((len(ids) - span) // windows, 1)
    accepted = drafted = used = 0
    for start in range(0, len(ids) - span, step)[:windows]:
        seq = greedy_continuation(model, ids[start : start + span].long(), new)
        a, d = sequence_acceptance(model, mtp, seq, prompt)
        accepted, drafted, used = accepted + a, drafted + d, used + 1
    return Acceptance(accepted, drafted, used)


@torch.inference_mode()
def text_agreement(
    model: DeepseekForCausalLM, mtp: MTPLayer, ids: Tensor, *, windows: int = 16, length: int = 128
) -> Acceptance:
    """On held-out text itself (its token t+1 fed): how often the draft equals the main
    model's greedy token at t+2. Greedy speculation accepts this only where the text's token
    t+1 is the main model's own; it shows the agreement on text a small model would not write."""
    step = max((len(ids) - length) // windows, 1)
    accepted = drafted = used = 0
    for start in range(0, len(ids) - length, step)[:windows]:
        seq = ids[start : start + length].long()
        main = model.prefill(seq, [length], all_logits=True)
        assert main.hidden is not None
        greedy = main.logits.argmax(-1)
        out = mtp_prefill(mtp, model.rope, seq[1:], main.hidden[:-1], [length - 1], all_logits=True)
        drafts = out.logits.argmax(-1)  # drafts[t]: token t+2; greedy[t+1] the main model's
        accepted += int((drafts[:-1] == greedy[1:-1]).sum())
        drafted += length - 2
        used += 1
    return Acceptance(accepted, drafted, used)
