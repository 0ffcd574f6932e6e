"""The leader's side of the MTP draft pass: the pass a step sends (`MtpPlan`), built from each
sequence's `MtpDrafts`, and the drafts the ranks fed, read back from the step's logits.

The ranks append the tokens every row was fed to the logits they return
(services/decode/rank/runtime.py), so the drafts reach the leader in the step's one gather.
On a GPU their copy to the host is queued before sampling and read after the sampler's one
awaited transfer, which it precedes on the stream: no wait of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from services.decode.leader.drafts import SEED, MtpDrafts, Proposer
from services.decode.leader.verify import StepRows
from services.decode.step_plan import MtpPlan, read_token_rows, token_row_count


def mtp_plan(
    proposers: Sequence[Proposer | None], rows: StepRows, hidden: int, chain: int
) -> MtpPlan | None:
    """The pass of a step whose rows are `rows` (sequence s's from rows.starts[s]): every
    MTP sequence's pending rows, then each drafting one's chain (`chain` drafts after the
    first, for every drafting sequence: the pass's shape); None when there is none.
    `hidden`: the model's hidden size (the seeds' width)."""
    passes: list[tuple[int, int, int, int]] = []
    drafts: list[tuple[int, int, int]] = []
    seeds: list[Tensor] = []
    for drafts_s, start, prop in zip(rows.drafts, rows.starts, proposers, strict=True):
        if not isinstance(prop, MtpDrafts) or not prop.rows:
            continue
        for src, token, position in prop.rows:
            if src == SEED:
                assert prop.seed is not None
                seeds.append(prop.seed.reshape(-1).float())
                src = -len(seeds)
            passes.append((src, token, position, start))
        if drafts_s:
            drafts.append((len(passes) - 1, start + 1, len(drafts_s)))
    if not passes:
        return None
    return MtpPlan(
        torch.tensor(passes, dtype=torch.int64).T.contiguous(),
        torch.tensor(drafts, dtype=torch.int64).reshape(-1, 3).T.contiguous(),
        torch.stack(seeds) if seeds else torch.zeros(0, hidden),
        chain,
    )


def fed_rows(parts: Tensor, size: int) -> Tensor:
    """Rank 0's rows of fed tokens, after its `size` logits rows in the gathered step."""
    return parts[0, size : size + token_row_count(size, parts.shape[-1])]


def start_copy(rows: Tensor) -> Tensor:
    """`fed_rows` on their way to the host (pinned memory, queued behind the step on a GPU):
    read them once a later awaited transfer has landed."""
    if rows.device.type == "cpu":
        return rows  # read within the step, before the next gather replaces it
    if rows.device.type != "cuda":
        return rows.to("cpu")
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    host.copy_(rows, non_blocking=True)
    return host


def fed_drafts(copied: Tensor, rows: StepRows) -> StepRows:
    """`rows` with the drafts the ranks fed in place of their placeholders, from the host
    copy of `fed_rows`."""
    fed = read_token_rows(copied, rows.total)
    return StepRows(
        [fed[a + 1 : a + 1 + len(d)] for a, d in zip(rows.starts, rows.drafts, strict=True)]
    )
