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
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from common.group.comm import Comm
from common.kv.paged_cache import CacheReads, PagedLatentCache
from common.runtime.host_syncs import host_side
from services.decode.rank.rank_model import RankModel
from services.decode.step_plan import MtpPlan

# Rows' positions and block tables -> where their latents go on this rank, what they read.
Address = Callable[[Tensor, Tensor], tuple[Tensor, CacheReads]]


def _on(t: Tensor, device: torch.device) -> Tensor:
    """A plan tensor (host) on the device without waiting for the device's queue."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def draft_pass(
    model: RankModel,
    plan: MtpPlan,
    tokens: Tensor,
    tables: Tensor,
    previous: Tensor | None,
    address: Address,
    cache: PagedLatentCache,
    comm: Comm,
) -> Tensor:
    """The step's tokens [B] with each drafting sequence's draft rows filled in. `tables`:
    this rank's step tables [B, W]; `previous`: the last step's hidden states [B', D]."""
    device = tokens.device
    # The plan's words are host tensors on every device: reading them waits for nothing.
    with host_side():
        src, ids, pos, table_rows = plan.rows
        first, dest, count = plan.drafts
        have = 0 if previous is None else previous.shape[0]
        hidden_rows = torch.where(src >= 0, src, have - 1 - src)
        chain = [
            (j, torch.nonzero(count > j)[:, 0]) for j in range(1, max(count.tolist(), default=0))
        ]
    seeds = _on(plan.seeds, device).to(model.lm_head.dtype)
    known = seeds if previous is None else torch.cat((previous, seeds))
    hidden = known[_on(hidden_rows, device)]
    pos_d, table_rows_d = _on(pos, device), _on(table_rows, device)
    slots, reads = address(pos_d, tables[table_rows_d])
    h, drafts = model.mtp_rows(_on(ids, device), hidden, pos_d, slots, reads, cache, comm)
    if plan.drafts.shape[1] == 0:
        return tokens
    first_d, dest_d = _on(first, device), _on(dest, device)
    out = tokens.clone()
    draft, h, at, rows = drafts[first_d], h[first_d], pos_d[first_d], table_rows_d[first_d]
    out[dest_d] = draft
    for j, active in chain:
        act = _on(active, device)
        p = at[act] + j
        slots, reads = address(p, tables[rows[act]])
        h_j, d_j = model.mtp_rows(draft[act], h[act], p, slots, reads, cache, comm)
        out[dest_d[act] + j] = d_j
        draft = draft.index_copy(0, act, d_j)
        h = h.index_copy(0, act, h_j)
    return out
