"""A MoE layer's routed experts over weights in the compute dtype: one by one, or grouped.

Both compute, for x [T, D], the slots sorted by held expert (`Routing`,
common/model/expert_routing.py) and the stacked weights of the experts a rank holds (gate_up
[E, 2I, D], gate rows first; down [E, D, I]; each a tensor or a quantized weight, FP8 or
INT4):

    out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])   over the slots j whose expert is held

- `routed_experts` is the reference: a Python loop over the experts, one matmul pair each
  over the rows routed to it; it reads the group ends on the host.
- `grouped_experts` runs both projections as one `grouped_mm` each over the sorted rows,
  SiLU * up between, the routing weights applied before the down projection.

FP8 weights are dequantized a bounded group of experts at a time, never a rank's whole
experts: one expert per step of the loop; `experts_per_group` of them per pair of grouped
GEMMs, into one buffer per role of at most DEQUANTIZED_BYTES together. A static routing
(`route`'s, no host read) brings each group's rows to the front by rotating the sorted rows
by the group's first row on the device; a sized one slices them.

`grouped_unsupported_on` says where this torch runs `grouped_mm` (device, dtype);
`grouped_unsupported` whether it takes a layer's weights (16-byte aligned strides).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from common.model.expert_routing import Routing, combine
from common.model.fp8 import DequantizedOnUse, Weight, dense_experts

# grouped_mm's kernels (CUDA's, and the CPU one here) require 16-byte aligned strides.
ALIGN_BYTES = 16
# A group's dequantized gate_up and down together, at most (quantized weights only). A group is
# one pair of grouped GEMMs: the fewer groups, the fewer launches and row rotations.
DEQUANTIZED_BYTES = 64 << 20

RoutedExperts = Callable[[Tensor, Routing, Weight, Weight], Tensor]


def experts_per_group(gate_up: Weight, down: Weight) -> int:
    """How many experts one pair of grouped GEMMs takes: all of them for tensors (views),
    as many as fit DEQUANTIZED_BYTES dequantized for quantized weights (at least one)."""
    held = gate_up.shape[0]
    if not isinstance(gate_up, DequantizedOnUse):
        return held
    size = torch.empty((), dtype=gate_up.dtype).element_size()
    per_expert = (gate_up.shape[1] * gate_up.shape[2] + down.shape[1] * down.shape[2]) * size
    return max(1, min(held, DEQUANTIZED_BYTES // per_expert))


def expert_ffn(xs: Tensor, gate_up: Tensor, down: Tensor, ends: Tensor, weight: Tensor) -> Tensor:
    """Rows xs [R, D] of groups ending at `ends` through their experts (gate_up [G, 2I, D],
    down [G, D, I]), each scaled by its routing weight -> [R, D]; rows past the last group
    are left uncomputed (uninitialized)."""
    two_i = gate_up.shape[1]
    gate, up = F.grouped_mm(xs, gate_up.transpose(1, 2), offs=ends).split(two_i // 2, dim=-1)
    h = (F.silu(gate) * up * weight[:, None]).to(xs.dtype)
    return F.grouped_mm(h, down.transpose(1, 2), offs=ends)


def routed_experts(x: Tensor, r: Routing, gate_up: Weight, down: Weight) -> Tensor:
    """The reference: one matmul pair per held expert over its rows -> [T, D]."""
    out = torch.zeros_like(x)
    bounds = r.host_bounds()
    for expert in range(r.held):
        start, stop = bounds[expert], bounds[expert + 1]
        if start == stop:
            continue
        tok = r.token[start:stop]
        w_gate_up = dense_experts(gate_up, expert, expert + 1, 1)[0]
        gate, up = F.linear(x[tok], w_gate_up).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, dense_experts(down, expert, expert + 1, 1)[0])
        out.index_add_(0, tok, (y * r.weight[start:stop, None]).to(x.dtype))
    return out


def grouped_experts(x: Tensor, r: Routing, gate_up: Weight, down: Weight) -> Tensor:
    """The held experts as grouped GEMMs over the sorted rows, a group of experts at a time
    (all at once for tensors) -> [T, D]."""
    held, per_group = r.held, experts_per_group(gate_up, down)
    if per_group >= held:  # one group: no rotation, no copy of the weights
        w_gate_up = dense_experts(gate_up, 0, held, held)
        w_down = dense_experts(down, 0, held, held)
        return combine(r, expert_ffn(x[r.token], w_gate_up, w_down, r.ends, r.weight))
    y = torch.zeros(r.rows, x.shape[1], dtype=x.dtype, device=x.device)
    if r.rows == 0:
        return combine(r, y)
    position = torch.arange(r.rows, device=x.device)
    for first in range(0, held, per_group):
        last = min(first + per_group, held)
        if r.bounds is not None and r.bounds[first] == r.bounds[last]:
            continue  # sized: no row is this group's, known on the host
        w_gate_up = dense_experts(gate_up, first, last, per_group)
        w_down = dense_experts(down, first, last, per_group)
        if r.bounds is not None:  # sized: the group's rows are a slice
            start, stop = r.bounds[first], r.bounds[last]
            ends = r.ends[first:last] - start
            part = r.weight[start:stop]
            y[start:stop] = expert_ffn(x[r.token[start:stop]], w_gate_up, w_down, ends, part)
            continue
        # Static: the sorted rows rotated on the device so that the group's come first; the
        # rows past its last are other groups' (or held elsewhere) and add zero.
        start = r.ends[first - 1] if first else r.ends.new_zeros(())
        ends = r.ends[first:last] - start
        rows = (position + start) % r.rows
        part = expert_ffn(x[r.token[rows]], w_gate_up, w_down, ends, r.weight[rows])
        y.index_add_(0, rows, torch.where((position < ends[-1])[:, None], part, 0))
    return combine(r, y)


def grouped_unsupported_on(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this torch cannot run `grouped_experts` on `device` in `dtype`, or None where it
    can (the weights' own sizes aside: `grouped_unsupported`)."""
    if not hasattr(F, "grouped_mm"):  # the public API arrived after some torch we run on
        return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
    if device.type == "cuda":
        if dtype != torch.bfloat16:
            return f"grouped_mm on CUDA runs bf16, not {dtype}"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "grouped_mm on CUDA needs compute capability 8.0 or newer"
    elif device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return f"grouped_mm does not run {dtype} on {device.type}"
    return None


def _placement(w: Weight) -> tuple[torch.device, torch.dtype, bool, bool]:
    """(device, compute dtype, contiguous, 16-byte aligned) of the tensor grouped_mm gets:
    an FP8 weight's dequantized buffer is a fresh contiguous allocation."""
    if isinstance(w, DequantizedOnUse):
        return w.device, w.dtype, True, True
    aligned = not w.numel() or w.data_ptr() % ALIGN_BYTES == 0
    return w.device, w.dtype, w.is_contiguous(), aligned


def grouped_unsupported(gate_up: Weight, down: Weight) -> str | None:
    """Why `grouped_experts` cannot run on these weights, or None where it can."""
    dev, dtype, contiguous, aligned = _placement(gate_up)
    why = grouped_unsupported_on(dev, dtype)
    if why is not None:
        return why
    down_dev, down_dtype, down_contiguous, down_aligned = _placement(down)
    if down_dtype != dtype or down_dev != dev:
        return "gate_up and down differ in dtype or device"
    if not (contiguous and down_contiguous):
        return "the stacked expert weights are not contiguous"
    size = torch.empty((), dtype=dtype).element_size()
    _, two_i, d = gate_up.shape
    for what, n in (("hidden_size", d), ("the expert intermediate size", two_i // 2)):
        if n * size % ALIGN_BYTES:
            return f"{what} ({n}) x {size} bytes is not a multiple of {ALIGN_BYTES} bytes"
    if not (aligned and down_aligned):
        return "the stacked expert weights are not 16-byte aligned"
    return None
