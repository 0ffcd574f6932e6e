"""FP8-resident weights: a linear weight kept as DeepSeek's block FP8, dequantized on use.

An `Fp8Weight` holds a slice of a block-quantized checkpoint tensor as stored: the
`float8_e4m3fn` values [*experts, R, C] and the float32 scales of the blocks the slice overlaps
(`weight_scale_inv`, one per `block` of the stored tensor). A slice may start and end inside a
block, and its rows may come from several runs of the stored rows (gate rows then up rows of
the experts, one head's W_UK rows of kv_b_proj): `rows` says, per run, which scale row each
row's block is.

`dequantize` writes `values * scale` into a buffer of the compute dtype: the e4m3 values are
copied in exactly (every serving dtype holds them), then multiplied by their float32 block
scale and rounded once, which is exactly what the reader's dequantize-at-load gives. A model's
weights share one `Fp8Workspace` of reused buffers, each bounded:
- a weight read as a tensor (`dense`, `weight`: W_UK / W_UV, a kv projection the model
  splits) gets a buffer per role and shape, reused by every layer;
- a weight applied as a linear (`forward`) without an FP8 GEMM is dequantized
  LINEAR_CHUNK_BYTES of rows at a time into one buffer shared by every linear;
- a stack of experts is dequantized a bounded group of experts at a time
  (`dequantize_experts`, common/model/experts.py), where no FP8 kernel reads it as it is.
Where the device runs one, an FP8 GEMM reads the values and scales as loaded instead
(`block_fp8`; common/model/fp8_gemm.py for linears, fp8_experts.py for the experts).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.triton_kernels.fp8_blocks import GROUP, BlockFp8

# A linear's dequantized rows at a time, at most (`Fp8Weight.forward`): every linear of a
# model takes its rows through one buffer of this size, whatever its role.
LINEAR_CHUNK_BYTES = 16 << 20
LINEAR_ROLE = "linear rows"


@dataclass(frozen=True)
class RowRun:
    """`length` held rows, the first at `offset` inside its block, whose block is scale row
    `base` (the following rows' blocks follow it)."""

    length: int
    offset: int
    base: int

    def blocks(self, block_rows: int) -> int:
        return math.ceil((self.offset + self.length) / block_rows)


class Fp8Workspace:
    """A model's reused dequantization buffers and the block indices they need, by role,
    shape, dtype and device. One model uses it from one thread at a time."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[object, ...], Tensor] = {}

    def buffer(
        self, role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        key = (role, shape, dtype, device)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(shape, dtype=dtype, device=device)
        return self._buffers[key]

    def row_blocks(self, runs: tuple[RowRun, ...], block_rows: int, device: torch.device) -> Tensor:
        key = ("rows", runs, block_rows, device)
        if key not in self._buffers:
            parts = [
                run.base + (run.offset + torch.arange(run.length)) // block_rows for run in runs
            ]
            self._buffers[key] = torch.cat(parts).to(device)
        return self._buffers[key]

    def col_blocks(self, offset: int, cols: int, block_cols: int, device: torch.device) -> Tensor:
        key = ("cols", offset, cols, block_cols, device)
        if key not in self._buffers:
            self._buffers[key] = ((offset + torch.arange(cols)) // block_cols).to(device)
        return self._buffers[key]


class DequantizedOnUse(nn.Module):
    """A weight kept quantized on its device and dequantized into a workspace buffer as it is
    used: block FP8 (`Fp8Weight`) or INT4 (common/model/int4.py `Int4Weight`)."""

    def __init__(self) -> None:
        super().__init__()
        self.workspace = Fp8Workspace()

    def dequantize(self, out: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def dequantize_experts(self, start: int, stop: int, capacity: int) -> Tensor:
        """Experts [start, stop) of a stacked weight [E, R, C] in the compute dtype, written
        into the workspace's buffer of `capacity` experts for this weight's role (a layer's
        experts taken a few at a time share one bounded buffer, overwritten by the next
        call)."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return next(self.buffers(recurse=False)).device

    @property
    def nbytes(self) -> int:
        """The bytes it holds on its device (values and scales)."""
        return sum(t.numel() * t.element_size() for t in self.buffers(recurse=False))

    @property
    def weight(self) -> Tensor:
        return self.dequantize()


class Fp8Weight(DequantizedOnUse):
    """A weight of logical `shape` kept in FP8 with its block scales; computes in `dtype`.

    It stands in for an `nn.Linear` (`weight`, `forward`) and for a stacked expert tensor.
    `role` names the buffer it dequantizes into: weights used at the same time (W_UK and W_UV,
    gate_up and down) have different roles.
    """

    def __init__(
        self,
        values: Tensor,
        scale: Tensor,
        rows: tuple[RowRun, ...],
        col_offset: int,
        block: tuple[int, int],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        role: str,
    ) -> None:
        super().__init__()
        assert values.dtype == torch.float8_e4m3fn and math.prod(shape) == values.numel()
        assert sum(r.length for r in rows) == values.shape[-2]
        assert scale.shape[-2] == sum(r.blocks(block[0]) for r in rows)
        self.register_buffer("values", values)
        self.register_buffer("scale", scale)
        self.rows, self.col_offset, self.block = rows, col_offset, block
        self.shape, self.dtype, self.role = shape, dtype, role
        cols = values.shape[-1]
        # Whole column blocks (the usual case) broadcast their scale instead of expanding it.
        self.whole_col_blocks = col_offset == 0 and cols % block[1] == 0
        # x @ W^T without dequantizing W (common/model/fp8_gemm.py `ScaledGemm`, called with
        # x and the values), where `assign_gemms` gave this weight one at load; else None.
        self.gemm: nn.Module | None = None

    values: Tensor
    scale: Tensor

    def dequantize(self, out: Tensor | None = None) -> Tensor:
        """The weight in `dtype` and `shape`, written into `out` (default: the workspace's
        buffer for this role, overwritten by the next weight of the same role)."""
        v = self.values
        if out is None:
            out = self.workspace.buffer(self.role, tuple(v.shape), self.dtype, v.device)
        return self._dequantize_into(v, self.scale, out.view(v.shape)).view(self.shape)

    def dequantize_experts(self, start: int, stop: int, capacity: int) -> Tensor:
        v = self.values
        assert v.dim() == 3 and 0 <= start < stop <= v.shape[0] and stop - start <= capacity
        key = (capacity, *v.shape[1:])
        out = self.workspace.buffer(self.role, key, self.dtype, v.device)[: stop - start]
        return self._dequantize_into(v[start:stop], self.scale[start:stop], out)

    def _dequantize_into(
        self, v: Tensor, scale: Tensor, out: Tensor, rows: slice = slice(None)
    ) -> Tensor:
        """`v` (this weight's values, or `rows` of them) times their block scales, in `out`."""
        out.copy_(v)
        ws = self.workspace
        s = scale.index_select(-2, ws.row_blocks(self.rows, self.block[0], v.device)[rows])
        if self.whole_col_blocks:
            out.view(*v.shape[:-1], -1, self.block[1]).mul_(s[..., None])
        else:
            cols = ws.col_blocks(self.col_offset, v.shape[-1], self.block[1], v.device)
            out.mul_(s.index_select(-1, cols))
        return out

    def block_fp8(self) -> BlockFp8 | str:
        """This weight as the Triton block-scaled GEMM reads it (a linear as one group of
        [1, N, K], a stack of experts as is), or why it cannot: each 128-column activation
        group must lie inside one stored column block."""
        v = self.values
        if not v.is_contiguous():
            return "values not contiguous"
        bc = self.block[1]
        straddle = f"a {GROUP}-column activation group would straddle two weight scales"
        if bc % GROUP:
            return f"{bc}-column weight blocks: {straddle}"
        if self.col_offset % GROUP:
            return f"columns from {self.col_offset} into a {bc}-wide block: {straddle}"
        rows = self.workspace.row_blocks(self.rows, self.block[0], v.device).int()
        groups = torch.arange(math.ceil(v.shape[-1] / GROUP), device=v.device)
        cols = ((self.col_offset + GROUP * groups) // bc).int()
        if v.dim() == 2:
            return BlockFp8(v[None], self.scale[None], rows, cols)
        return BlockFp8(v, self.scale, rows, cols)

    def forward(self, x: Tensor) -> Tensor:
        """x @ W^T: by the weight's GEMM, else dequantized LINEAR_CHUNK_BYTES of rows at a
        time into the workspace's one buffer for every linear (used only during the call),
        each chunk's output columns computed from it."""
        if self.gemm is not None:
            return self.gemm(x, self.values)
        v = self.values
        n, c = v.shape
        size = torch.empty((), dtype=self.dtype).element_size()
        step = max(1, LINEAR_CHUNK_BYTES // (c * size))
        key = (max(LINEAR_CHUNK_BYTES // size, c),)
        flat = self.workspace.buffer(LINEAR_ROLE, key, self.dtype, v.device)
        if step >= n:
            return F.linear(x, self._dequantize_into(v, self.scale, flat[: n * c].view(n, c)))
        out = x.new_empty(*x.shape[:-1], n)
        for start in range(0, n, step):
            rows = slice(start, min(n, start + step))
            part = flat[: (rows.stop - start) * c].view(-1, c)
            out[..., rows] = F.linear(x, self._dequantize_into(v[rows], self.scale, part, rows))
        return out

    def take_rows(
        self, runs: list[tuple[int, int]], shape: tuple[int, ...], role: str
    ) -> Fp8Weight:
        """The rows [start, stop) of each of `runs` (of a weight with one row run, e.g. one
        head's W_UK rows of a kv_b_proj slice), with only the scale rows they use."""
        assert len(self.rows) == 1
        (run,), b0 = self.rows, self.block[0]
        values, scales, held = [], [], []
        for start, stop in runs:
            first = (run.offset + start) // b0
            new = RowRun(stop - start, (run.offset + start) % b0, sum(r.blocks(b0) for r in held))
            held.append(new)
            values.append(self.values[..., start:stop, :])
            scales.append(self.scale[..., run.base + first : run.base + first + new.blocks(b0), :])
        return Fp8Weight(
            torch.cat(values, dim=-2).contiguous(),
            torch.cat(scales, dim=-2).contiguous(),
            tuple(held),
            self.col_offset,
            self.block,
            shape,
            self.dtype,
            role,
        )


Weight = Tensor | DequantizedOnUse


def dense(w: Weight) -> Tensor:
    """`w` as a tensor in the compute dtype (an FP8 or INT4 weight dequantized into its
    buffer)."""
    return w.dequantize() if isinstance(w, DequantizedOnUse) else w


def dense_experts(w: Weight, start: int, stop: int, capacity: int) -> Tensor:
    """Experts [start, stop) of a stacked expert weight in the compute dtype: a view of a
    tensor, a quantized weight's dequantized into its bounded buffer (`dequantize_experts`)."""
    if isinstance(w, DequantizedOnUse):
        return w.dequantize_experts(start, stop, capacity)
    return w[start:stop]


def linear(x: Tensor, w: Weight) -> Tensor:
    """x @ w^T: a quantized weight by its own GEMM (scaled_mm, or dequantized on use)."""
    return w(x) if isinstance(w, DequantizedOnUse) else F.linear(x, w)


def held(w: Weight) -> nn.Parameter | DequantizedOnUse:
    """`w` as a module attribute: a tensor as a parameter, a quantized weight as it is."""
    return w if isinstance(w, DequantizedOnUse) else nn.Parameter(w)


def share_workspace(model: nn.Module) -> Fp8Workspace:
    """Give every FP8 or INT4 weight of `model` one workspace (a model's steps run one at a
    time; two models, e.g. two ranks in one process, never share one)."""
    workspace = Fp8Workspace()
    for module in model.modules():
        if isinstance(module, DequantizedOnUse):
            module.workspace = workspace
    return workspace


def cat_rows(parts: list[Fp8Weight], shape: tuple[int, ...], role: str) -> Fp8Weight:
    """`parts` one after the other along their rows (gate rows, then up rows)."""
    first = parts[0]
    runs: list[RowRun] = []
    base = 0
    for part in parts:
        assert part.col_offset == first.col_offset and part.block == first.block
        for run in part.rows:
            runs.append(RowRun(run.length, run.offset, base + run.base))
        base += part.scale.shape[-2]
    return Fp8Weight(
        torch.cat([p.values for p in parts], dim=-2),
        torch.cat([p.scale for p in parts], dim=-2),
        tuple(runs),
        first.col_offset,
        first.block,
        shape,
        first.dtype,
        role,
    )


def stack(build: Callable[[int], Fp8Weight], count: int, role: str) -> Fp8Weight:
    """`count` experts' weights of one shape, sliced alike, stacked [E, R, C]: `build(e)`
    makes expert e's, copied in one at a time (the stack is never held twice)."""
    first = build(0)
    values = first.values.new_empty((count, *first.values.shape))
    scale = first.scale.new_empty((count, *first.scale.shape))
    for e in range(count):
        part = first if e == 0 else build(e)
        assert part.rows == first.rows and part.col_offset == first.col_offset
        values[e], scale[e] = part.values, part.scale
        del part
    return Fp8Weight(
        values,
        scale,
        first.rows,
        first.col_offset,
        first.block,
        (count, *first.shape),
        first.dtype,
        role,
    )
