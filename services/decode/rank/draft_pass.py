"""The MTP draft pass of a decode step: the drafts a step verifies, made on the ranks first.

It runs inside the step, before the main model's rows, so the drafts never go to the host
and back: the leader sends the pass (an `MtpPlan`) with the step and learns the drafts with
the step's logits, in the step's one host wait. A separate step op would need the leader to
read the drafts before it could send the verify step: a second wait every step.

First the MTP module runs over each sequence's new positions (the previous step's kept rows,
or a prefill's last position), reading the main model's hidden state there and the token
after it, and writing its latents into its own cache layer: row t's latent is final, since
tokens t and t + 1 are. The last row's greedy pick is draft 1. Draft j > 1 runs the module
at the next position on draft j - 1 and its own output hidden state (V3's chaining); those
latents are provisional, overwritten by the next step's pass from the kept tokens.

Its shapes are its plan's (padded to the step's bucket by the leader) and the chain's length
(every drafting sequence runs it, those with fewer drafts write theirs nowhere): no count
decides a shape on the host, so a captured CUDA graph replays the pass with its step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from common.group.comm import Comm
from common.kv.paged_cache import CacheReads, PagedLatentCache
from services.decode.rank.rank_model import RankModel
from services.decode.step_plan import MtpPlan

# Rows' positions and block tables -> where their latents go on this rank, what they read.
Address = Callable[[Tensor, Tensor], tuple[Tensor, CacheReads]]
# Table rows [R] -> their block tables [R, W] (the step's width).
Tables = Callable[[Tensor], Tensor]


def draft_pass(
    model: RankModel,
    plan: MtpPlan,
    tokens: Tensor,
    table_rows: Tensor,
    tables: Tables,
    known: Tensor,
    address: Address,
    cache: PagedLatentCache,
    comm: Comm,
) -> Tensor:
    """The step's tokens [B] with each drafting sequence's draft rows filled in.

    `table_rows` [B + 1]: each step row's table row, then the padding row's (all -1: what a
    padding pass row or an idle chained draft writes to, the trash slot); `known` [2R, D]:
    the last step's hidden states in rows [0, R), the plan's seeds in rows [R, 2R). Device
    work only, its shapes the plan's: a captured step runs it."""
    b = tokens.shape[0]
    src, ids, pos, step_rows = plan.rows
    first, dest, count = plan.drafts
    seed_base = known.shape[0] // 2
    hidden = known[torch.where(src >= 0, src, seed_base - 1 - src)]
    slots, reads = address(pos, tables(table_rows[step_rows]))
    h, drafts = model.mtp_rows(ids, hidden, pos, slots, reads, cache, comm)
    if plan.drafts.shape[1] == 0:
        return tokens
    # Row b of `out` is nowhere: a padding draft's, an idle chained draft's.
    out = torch.cat((tokens, tokens.new_zeros(1)))
    draft, h, at, rows = drafts[first], h[first], pos[first], step_rows[first]
    out[dest] = draft
    for j in range(1, plan.chain + 1):
        active = count > j
        p = torch.where(active, at + j, 0)
        slots, reads = address(p, tables(table_rows[torch.where(active, rows, b)]))
        h_j, d_j = model.mtp_rows(draft, h, p, slots, reads, cache, comm)
        out[torch.where(active, dest + j, b)] = d_j
        draft = torch.where(active, d_j, draft)
        h = torch.where(active[:, None], h_j, h)
    return out[:b]
