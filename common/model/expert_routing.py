"""A MoE layer's routed slots sorted by the held expert that runs them, and the experts'
outputs summed back per token.

For x's T tokens with expert ids / routing weights [T, k], slot t * k + j is token t's j-th
choice. `route` sorts the slots by the expert they go to, among the E experts a rank holds
(global experts first .. first + E - 1; a slot routed to an expert held elsewhere, under
expert parallelism, sorts after every group): expert e's slots are rows [ends[e-1], ends[e])
of every sorted-row tensor, its `token` (the row of x it reads) and its `weight`.

Two ways, one per kind of caller:
- static (a decode step): every one of the T * k slots has a row, so shapes follow T alone
  and nothing is read back to the host (a CUDA graph holds it); rows past the last group
  are the slots held elsewhere, and `combine` zeroes them.
- sized (a prefill model under expert parallelism): the group ends are read to the host once
  (`bounds`) and only the held slots get rows, about T * k / tp of them instead of T * k.

`combine` sums each token's rows of the experts' output [rows, D] (the routing weights
already applied) into [T, D].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Routing:
    """The slots sorted by held expert. `order` [rows]: each row's slot; `ends` [E] int32:
    each expert's end row; `token` [rows] int64: each row's token; `weight` [rows] fp32:
    each row's routing weight (0 for a slot held elsewhere); `bounds`: [0, *ends] read on
    the host (sized), else None."""

    tokens: int
    top_k: int
    order: Tensor
    ends: Tensor
    token: Tensor
    weight: Tensor
    bounds: list[int] | None = None

    @property
    def rows(self) -> int:
        return self.order.shape[0]

    @property
    def held(self) -> int:
        return self.ends.shape[0]

    def host_bounds(self) -> list[int]:
        """[0, *ends] on the host: the sized routing's own, else read now (a host sync)."""
        return self.bounds if self.bounds is not None else [0, *self.ends.tolist()]


def route(ids: Tensor, weights: Tensor, held: int, first: int = 0, sized: bool = False) -> Routing:
    """The slots of ids / weights [T, k] sorted by the `held` experts first .. first + held - 1
    (stable: a group's slots keep their order); sized: only the held slots (one host read)."""
    t, k = ids.shape
    local = ids.flatten() - first
    is_held = (local >= 0) & (local < held)
    # Slots routed elsewhere sort after every group, into the last bin.
    local = torch.where(is_held, local, held)
    local_sorted, order = local.sort(stable=True)
    ends = torch.arange(1, held + 1, device=ids.device, dtype=local.dtype)
    ends = torch.searchsorted(local_sorted, ends, out_int32=True)
    weight = torch.where(is_held, weights.flatten(), 0.0)
    bounds = None
    if sized:
        bounds = [0, *ends.tolist()]
        order = order[: bounds[-1]]
    return Routing(t, k, order, ends, order // k, weight[order].float(), bounds)


def combine(r: Routing, y: Tensor) -> Tensor:
    """[T, D]: each token's sum over its rows of y [rows, D] (the rows past the last group,
    slots held elsewhere, count zero and may hold anything)."""
    t, k, d = r.tokens, r.top_k, y.shape[1]
    if r.bounds is None:
        # Rows past the last group are uninitialized memory, not zeros.
        held = torch.arange(r.rows, device=y.device) < r.ends[-1:]
        y = torch.where(held[:, None], y, 0)
        return torch.empty_like(y).index_copy_(0, r.order, y).view(t, k, d).sum(1)
    rows = r.rows
    out = torch.zeros(t, d, dtype=torch.float32, device=y.device)
    if rows == 0:
        return out.to(y.dtype)
    # Each slot's row, `rows` where none: k gathers of [T, D] instead of one of [T * k, D].
    row_of = torch.full((t * k,), rows, dtype=torch.long, device=y.device)
    row_of[r.order] = torch.arange(rows, device=y.device)
    row_of = row_of.view(t, k)
    for j in range(k):
        row = row_of[:, j]
        out += torch.where((row < rows)[:, None], y[row.clamp(max=rows - 1)], 0).float()
    return out.to(y.dtype)
