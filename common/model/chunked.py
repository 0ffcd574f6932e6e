"""One prompt prefilled chunk by chunk through any `prefill(ids, seq_lens, *, past, ...)`:
each chunk attends over the earlier chunks' latents as its `PastLatents`. The single-prompt
reference of the prefill worker's chunking (services/prefill/batch/progress.py), and the way a
long prompt is prefilled where no worker runs (tests, the long-context oracle)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from common.model.causal_lm import PastLatents, PrefillOutput


class Prefill(Protocol):
    def __call__(
        self,
        input_ids: Tensor,
        seq_lens: list[int],
        *,
        all_logits: bool = ...,
        absorbed: bool = ...,
        past: list[PastLatents | None] | None = ...,
    ) -> PrefillOutput: ...


def prefill_in_chunks(
    prefill: Prefill, input_ids: Tensor, chunk: int, *, absorbed: bool = False
) -> PrefillOutput:
    """`prefill(input_ids, [len])` of one prompt, `chunk` tokens at a time (0: at once).
    The logits are the last token's [1, V]; the latents cover the whole prompt."""
    total = int(input_ids.shape[0])
    step = chunk or total
    n: list[Tensor] = []
    k_pe: list[Tensor] = []
    keys: list[Tensor] = []
    out = None
    for lo in range(0, total, step):
        piece = input_ids[lo : lo + step]
        past = PastLatents(n, k_pe, keys) if lo else None
        out = prefill(piece, [int(piece.shape[0])], absorbed=absorbed, past=[past])
        if lo:
            n = [torch.cat([a, b]) for a, b in zip(n, out.n, strict=True)]
            k_pe = [torch.cat([a, b]) for a, b in zip(k_pe, out.k_pe, strict=True)]
            keys = [torch.cat([a, b]) for a, b in zip(keys, out.index_keys, strict=True)]
        else:
            n, k_pe, keys = list(out.n), list(out.k_pe), list(out.index_keys)
    assert out is not None, "an empty prompt"
    return PrefillOutput(out.logits, n, k_pe, index_keys=keys)
