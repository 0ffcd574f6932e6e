"""A MoE layer's routed experts run over the tokens routed to them, grouped or one by one.

Both compute, for x [T, D], expert ids / routing weights [T, k] and the stacked weights of the
experts a rank holds (gate_up [E, 2I, D], gate rows first; down [E, D, I]; expert e of the
stack is global expert `first + e`):

    out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])   over the slots j whose expert is held

A slot routed to an expert held elsewhere (expert parallelism) contributes zero here.

- `routed_experts` is the reference: a Python loop over the experts, one matmul each over the
  tokens routed to it; it reads the per-expert counts on the host (`.tolist()`).
- `grouped_experts` routes on the device: the T*k slots sorted by expert, each group's end by
  `searchsorted` (no host read), both projections as one `grouped_mm` each, SiLU * up between,
  the routing weights applied before the down projection, then a `view(T, k, D).sum(1)`.

`select_experts_kernel` is the selector (TPLA_EXPERTS_KERNEL, by the rule of
common/runtime/kernel_choice.py): `grouped` where this torch runs `grouped_mm` on the device in
the dtype (`grouped_unsupported_on`), else `loop`. A layer's weights that the grouped GEMMs
cannot take (strides that are not 16-byte aligned: `grouped_unsupported`) run the loop under
either choice (`loop_reason`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from common.runtime.kernel_choice import KernelChoice, choose_kernel, setting_of

RoutedExperts = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int], Tensor]

# grouped_mm's kernels (CUDA's, and the CPU one here) require 16-byte aligned strides.
ALIGN_BYTES = 16


def routed_experts(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor, first: int = 0
) -> Tensor:
    """The reference: one matmul per held expert over the tokens routed to it -> [T, D]."""
    out = torch.zeros_like(x)
    n_local = gate_up.shape[0]
    local = ids.flatten() - first
    # Slots routed elsewhere count in the last bin, which the loop never runs.
    local = torch.where((local >= 0) & (local < n_local), local, n_local)
    order = local.argsort(stable=True)
    counts = torch.bincount(local, minlength=n_local + 1).tolist()
    token_of = order // ids.shape[1]
    w_sorted = weights.flatten()[order]
    start = 0
    for expert, count in enumerate(counts[:n_local]):
        if count == 0:
            continue
        tok = token_of[start : start + count]
        gate, up = F.linear(x[tok], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, tok, (y * w_sorted[start : start + count, None]).to(x.dtype))
        start += count
    return out


def grouped_experts(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor, first: int = 0
) -> Tensor:
    """The held experts as two grouped GEMMs, routed on the device -> [T, D]."""
    t, k = ids.shape
    n_local, two_i, d = gate_up.shape
    local = ids.flatten() - first
    held = (local >= 0) & (local < n_local)
    # Slots routed elsewhere sort after every group: grouped_mm leaves them uncomputed.
    local = torch.where(held, local, n_local)
    local_sorted, order = local.sort(stable=True)
    ends = torch.arange(1, n_local + 1, device=ids.device, dtype=local.dtype)
    offs = torch.searchsorted(local_sorted, ends, out_int32=True)
    held_sorted = held[order]
    w_sorted = torch.where(held, weights.flatten(), 0.0)[order]
    xs = x[order // k]
    gate, up = F.grouped_mm(xs, gate_up.transpose(1, 2), offs=offs).split(two_i // 2, dim=-1)
    h = (F.silu(gate) * up * w_sorted[:, None]).to(x.dtype)
    y = F.grouped_mm(h, down.transpose(1, 2), offs=offs)
    # Rows past the last group are uninitialized memory, not zeros.
    y = torch.where(held_sorted[:, None], y, 0)
    return torch.empty_like(y).index_copy_(0, order, y).view(t, k, d).sum(1)


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


def grouped_unsupported(gate_up: Tensor, down: Tensor) -> str | None:
    """Why `grouped_experts` cannot run on these weights, or None where it can."""
    dev, dtype = gate_up.device, gate_up.dtype
    why = grouped_unsupported_on(dev, dtype)
    if why is not None:
        return why
    if down.dtype != dtype or down.device != dev:
        return "gate_up and down differ in dtype or device"
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        return "the stacked expert weights are not contiguous"
    size = gate_up.element_size()
    _, two_i, d = gate_up.shape
    for what, n in (("hidden_size", d), ("the expert intermediate size", two_i // 2)):
        if n * size % ALIGN_BYTES:
            return f"{what} ({n}) x {size} bytes is not a multiple of {ALIGN_BYTES} bytes"
    for t in (gate_up, down):
        if t.numel() and t.data_ptr() % ALIGN_BYTES:
            return "the stacked expert weights are not 16-byte aligned"
    return None


def select_experts_kernel(asked: str, device: torch.device, dtype: torch.dtype) -> KernelChoice:
    """The routed experts' kernel for weights on `device` in `dtype` (TPLA_EXPERTS_KERNEL:
    auto | grouped | loop), by the kernel-choice rule."""
    checks = {"grouped": lambda: grouped_unsupported_on(device, dtype), "loop": lambda: None}
    return choose_kernel("experts", asked, checks, ("grouped", "loop"))


def loop_reason(kernel: str, gate_up: Tensor, down: Tensor) -> str | None:
    """Why these weights run the per-expert loop under the chosen `kernel` (grouped |
    loop), or None: they run the grouped GEMMs."""
    if kernel == "loop":
        return f"the loop was chosen ({setting_of('experts')})"
    return grouped_unsupported(gate_up, down)
