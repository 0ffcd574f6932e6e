"""Which cached tokens a sparse-attention query attends over: the `k` highest index scores
among its valid tokens, ties broken by position (lower first), every valid token when it has
at most `k`.

`torch.topk` breaks ties in no stated order, and ReLU plus signed head weights make equal
scores common; one rule, applied everywhere (prefill, decode, each layout), makes every path
select the same set. `topk_mask` is the static-shape form the engine runs (the k-th value from
`topk`, which ties cannot change, then a running count among the tied); `topk_mask_reference`
is a stable sort, its reference. `threshold` is the same rule over candidates gathered from
several ranks (SP), whose global positions break the ties. Math only.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Past any position: pads a rank's candidates where it holds fewer than k tokens.
NO_POSITION = torch.iinfo(torch.int64).max


def topk_mask(scores: Tensor, valid: Tensor, k: int) -> Tensor:
    """[..., T] fp32 scores and valid mask -> the selected tokens' mask [..., T]."""
    if k >= scores.shape[-1]:
        return valid.clone()
    s = scores.masked_fill(~valid, -torch.inf)
    kth = s.topk(k, dim=-1).values[..., -1:]
    above = s > kth
    tied = (s == kth) & valid
    room = k - above.sum(-1, keepdim=True)
    return (above | (tied & (tied.cumsum(-1) <= room))) & valid


def topk_mask_reference(scores: Tensor, valid: Tensor, k: int) -> Tensor:
    """`topk_mask` by a stable descending sort (equal scores keep position order)."""
    s = scores.masked_fill(~valid, -torch.inf)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :k]
    picked = torch.zeros_like(valid).scatter_(-1, order, True)
    return picked & valid


def mask_positions(mask: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The selected tokens of a mask [..., T] with at most k set -> their positions [..., k]
    in ascending order (0 past the count) and the count [...]: static shapes, no host read."""
    running = mask.cumsum(-1)
    count = running[..., -1]
    t = mask.shape[-1]
    dest = torch.where(mask, running - 1, k)  # unselected tokens all land in a spare slot
    pos = torch.arange(t, device=mask.device).expand_as(mask)
    out = torch.zeros(*mask.shape[:-1], k + 1, dtype=torch.int64, device=mask.device)
    return out.scatter_(-1, dest, pos)[..., :k], count


def candidates(scores: Tensor, valid: Tensor, positions: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """A rank's k best tokens under the rule: scores [R, T] at global `positions` [R, T] ->
    their scores [R, k] (-inf past the rank's valid tokens) and positions [R, k]
    (NO_POSITION there), what `threshold` merges across ranks."""
    mask = topk_mask(scores, valid, min(k, scores.shape[-1]))
    local, count = mask_positions(mask, k)
    have = torch.arange(k, device=scores.device)[None] < count[:, None]
    best = scores.gather(-1, local).masked_fill(~have, -torch.inf)
    at = positions.gather(-1, local).masked_fill(~have, NO_POSITION)
    return best, at


def threshold(scores: Tensor, positions: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k-th of candidates [R, N] under the rule (score descending, position ascending) ->
    its score [R, 1] and position [R, 1]: a token is selected iff it sorts at or before them.
    With fewer than k real candidates it is (-inf, NO_POSITION): every valid token is."""
    by_position = torch.sort(positions, dim=-1, stable=True)
    ordered = scores.gather(-1, by_position.indices)
    order = torch.sort(ordered, dim=-1, descending=True, stable=True).indices[..., k - 1 : k]
    return ordered.gather(-1, order), by_position.values.gather(-1, order)


def within(scores: Tensor, positions: Tensor, valid: Tensor, kth: tuple[Tensor, Tensor]) -> Tensor:
    """The valid tokens (scores, global positions [R, T]) at or before the threshold `kth`."""
    score, position = kth
    return valid & ((scores > score) | ((scores == score) & (positions <= position)))
