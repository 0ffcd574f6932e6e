"""Read a safetensors checkpoint slice by slice, straight into the serving dtype and device.

A single `model.safetensors` or the shards of `model.safetensors.index.json`. A read takes
the rows / columns asked for with `get_slice` and copies them out. safetensors maps the whole
file into the process: a private mapping whose touched pages count as this process's memory
until the file is closed. So one file is open at a time, and it is closed once the reads
through it have touched `READ_CHUNK_BYTES` (larger reads go in chunks of that size): a rank
holds the slices it keeps plus at most one chunk of mapped pages, and opens each file about
once per chunk, not once per tensor (an open parses the file's header: ~2 ms for a shard of
DeepSeek-V3, with ~100k reads per rank).

FP8 checkpoints in DeepSeek-V3's format (`quantization_config.quant_method: fp8`) store a
linear weight `W` as `float8_e4m3fn` with `W_scale_inv`, one float32 per `weight_block_size`
block (shape ceil-divided). A slice is dequantized on its own, with the scales of the blocks
it overlaps (a slice may start mid-block): `w * scale` in float32, then cast to the serving
dtype, which is exactly what dequantizing the whole file beforehand and casting gives. Or a
slice is read as stored (`read_quantized`): its e4m3 values and the scales of the blocks it
overlaps, for weights kept in FP8 (common/model/fp8.py).

compressed-tensors' pack-quantized INT4 (Kimi's routed experts: `X.weight_packed`,
`X.weight_scale`, `X.weight_shape`) is listed as `X.weight` with its logical shape; a read
dequantizes its slice with `dequantize_int4` (common/triton_kernels/int4_packing.py), or
`read_int4` gives the words and group scales as stored, for weights kept in INT4.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from common.runtime.load_meter import current_meter
from common.triton_kernels.int4_packing import INT4_PACK, dequantize_int4

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"
INT4_PACKED = "weight_packed"
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "BOOL": torch.bool,
}

Index = Sequence[slice]
# Reads larger than this are split by leading rows (see `CheckpointReader.read`).
READ_CHUNK_BYTES = 64 * 2**20


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match its config (or cannot be read)."""


class UnsupportedQuantization(CheckpointError):
    """The checkpoint is quantized with a method the loader cannot dequantize."""


@dataclass(frozen=True)
class Quantization:
    """How the checkpoint stores its linear weights: plain (method None), block FP8, or
    compressed-tensors' pack-quantized INT4 with group scales (`group`: its group size)."""

    method: str | None = None
    block: tuple[int, int] = (128, 128)
    group: int = 0

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> Quantization:
        quant = raw.get("quantization_config") or (raw.get("text_config") or {}).get(
            "quantization_config"
        )
        if not quant:
            return cls()
        method = quant.get("quant_method")
        if method == "compressed-tensors":
            return cls(method, group=int4_group(quant))
        if method != "fp8":
            raise UnsupportedQuantization(
                f"quantization_config.quant_method {method!r} is not supported: DeepSeek's "
                "block-wise 'fp8' (weight_block_size) and compressed-tensors' pack-quantized "
                "INT4 are; dequantize the checkpoint first"
            )
        block = quant.get("weight_block_size") or [128, 128]
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise UnsupportedQuantization(
                f"quantization_config.weight_block_size {block!r} is not [rows, cols]"
            )
        return cls(method, (block[0], block[1]))

    @classmethod
    def from_dir(cls, model_dir: Path) -> Quantization:
        path = model_dir / "config.json"
        return cls.from_config(json.loads(path.read_text())) if path.is_file() else cls()


def int4_group(quant: dict[str, Any]) -> int:
    """The group size of a compressed-tensors config the loader reads: pack-quantized,
    every group's weights symmetric 4-bit integers with per-group scales, no activation
    quantization (Kimi K2-Thinking / K2.5 / K2.6's experts)."""
    fmt = quant.get("format")
    groups = list((quant.get("config_groups") or {}).values())
    sizes = set()
    for group in groups:
        w = group.get("weights") or {}
        scheme = (w.get("num_bits"), w.get("type"), w.get("symmetric"), w.get("strategy"))
        if scheme != (4, "int", True, "group") or group.get("input_activations"):
            raise UnsupportedQuantization(
                f"compressed-tensors scheme {w} (activations {group.get('input_activations')}) "
                "is not supported: only symmetric 4-bit integer weights with group scales are"
            )
        sizes.add(int(w.get("group_size") or 0))
    if fmt != "pack-quantized" or len(sizes) != 1 or min(sizes) % INT4_PACK:
        raise UnsupportedQuantization(
            f"compressed-tensors format {fmt!r} with group sizes {sorted(sizes)} is not supported: "
            f"pack-quantized with one group size, a multiple of {INT4_PACK}"
        )
    return sizes.pop()


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        raise CheckpointError(
            f"no model.safetensors or model.safetensors.index.json in {model_dir}"
        )
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"checkpoint shards listed in the index are missing: {missing}")
    return files


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Int4Slice:
    """A slice of a pack-quantized INT4 weight as stored: its int32 words and group scales."""

    packed: Tensor  # int32 [..., rows, cols / 8]
    scale: Tensor  # [..., rows, cols / group], the checkpoint's float dtype


@dataclass(frozen=True)
class QuantizedSlice:
    """A slice of an FP8 tensor as stored, with the scales of the blocks it overlaps."""

    values: Tensor  # float8 [..., rows, cols]
    scale: Tensor  # float32 [..., block rows, block cols]
    row_offset: int  # the first row's offset inside its block
    col_offset: int  # the first column's offset inside its block


class CheckpointReader:
    """Names, shapes and sliced reads of a checkpoint's tensors (headers only at start)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.quant = Quantization.from_dir(self.model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        for path in checkpoint_files(self.model_dir):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    part = f.get_slice(name)
                    dtype = _SAFETENSORS_DTYPES.get(part.get_dtype())
                    if dtype is None:
                        raise CheckpointError(f"{name}: unsupported dtype {part.get_dtype()}")
                    self.tensors[name] = TensorInfo(path, tuple(part.get_shape()), dtype)
        # An INT4 weight `X.weight` is stored as X.weight_packed / _scale / _shape: it is
        # listed under its own name, with its logical shape and its scales' dtype.
        self.int4: dict[str, tuple[str, str]] = {}
        self._int4_parts: set[str] = set()
        for name in [n for n in self.tensors if n.endswith(INT4_PACKED)]:
            base = name.removesuffix(INT4_PACKED) + "weight"
            scale, packed = base + "_scale", self.tensors[name]
            if self.quant.group == 0 or scale not in self.tensors:
                raise CheckpointError(
                    f"{name}: packed INT4 without a compressed-tensors quantization_config "
                    f"or without its {scale}"
                )
            shape = (*packed.shape[:-1], packed.shape[-1] * INT4_PACK)
            self.tensors[base] = TensorInfo(packed.file, shape, self.tensors[scale].dtype)
            self.int4[base] = (name, scale)
            self._int4_parts |= {name, scale, base + "_shape"}
        self._file: Path | None = None
        self._handle: Any = None  # safe_open of self._file
        self._touched = 0  # bytes of self._file spanned by reads since it was opened
        # Where the stored bytes of each slice read are counted: the loading rank's progress
        # (common/runtime/load_meter.py), when it is metered.
        self._meter = current_meter()
        self._check_quantized()

    def _check_quantized(self) -> None:
        """Every FP8 tensor has a float scale per block; found before anything is read."""
        for name, info in self.tensors.items():
            if info.dtype not in FP8_DTYPES:
                continue
            if self.quant.method != "fp8":
                raise CheckpointError(
                    f"{name} is stored in {info.dtype} but config.json has no "
                    "quantization_config with quant_method 'fp8'"
                )
            if len(info.shape) < 2:
                raise CheckpointError(f"{name}: an FP8 tensor of shape {info.shape} has no blocks")
            scale = self.tensors.get(name + SCALE_SUFFIX)
            if scale is None:
                raise CheckpointError(f"{name}: FP8 weight without its scale {name}{SCALE_SUFFIX}")
            expected = self.scale_shape(info.shape)
            if scale.shape != expected or not scale.dtype.is_floating_point:
                raise CheckpointError(
                    f"{name}{SCALE_SUFFIX}: shape {scale.shape} ({scale.dtype}); expected "
                    f"{expected} floats, one per {self.quant.block} block of {name} {info.shape}"
                )

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(shape) < 2:
            return shape
        (b0, b1), (rows, cols) = self.quant.block, shape[-2:]
        return (*shape[:-2], math.ceil(rows / b0), math.ceil(cols / b1))

    def is_scale(self, name: str) -> bool:
        """A scale, or a part of an INT4 weight: read with its weight, never on its own."""
        if name in self._int4_parts:
            return True
        base = name.removesuffix(SCALE_SUFFIX)
        return base != name and base in self.tensors and self.tensors[base].dtype in FP8_DTYPES

    def is_fp8(self, name: str) -> bool:
        info = self.tensors.get(name)
        return info is not None and info.dtype in FP8_DTYPES

    def read_quantized(
        self, name: str, index: Index = (), *, device: torch.device | str = "cpu"
    ) -> QuantizedSlice:
        """Tensor `name`[index] of an e4m3 weight as stored, and its blocks' scales."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"missing: {name}")
        if info.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"{name} is {info.dtype}, not float8_e4m3fn: it has no FP8 form")
        bounds = _bounds(name, index, info.shape)
        values = self.read(name, index, dtype=info.dtype, device=device)
        scale = self.read(
            name + SCALE_SUFFIX, self._scale_index(bounds), dtype=torch.float32, device=device
        )
        b0, b1 = self.quant.block
        return QuantizedSlice(values, scale, bounds[-2][0] % b0, bounds[-1][0] % b1)

    def read_int4(
        self, name: str, index: Index = (), *, device: torch.device | str = "cpu"
    ) -> Int4Slice:
        """INT4 weight `name`[index] as stored: its words and the scales of its groups (a
        column slice starts and ends on a group's edge)."""
        packed, scale = self.int4[name]
        bounds = _bounds(name, index, self.tensors[name].shape)
        (c0, c1), g = bounds[-1], self.quant.group
        if c0 % g or (c1 % g and c1 != self.tensors[name].shape[-1]):
            raise CheckpointError(f"{name}: columns [{c0}, {c1}) cut INT4 groups of {g}")
        lead = [slice(a, b) for a, b in bounds[:-1]]
        words = self.read(
            packed,
            [*lead, slice(c0 // INT4_PACK, -(-c1 // INT4_PACK))],
            dtype=torch.int32,
            device=device,
        )
        scales = self.read(
            scale,
            [*lead, slice(c0 // g, -(-c1 // g))],
            dtype=self.tensors[scale].dtype,
            device=device,
        )
        return Int4Slice(words, scales)

    def _scale_index(self, bounds: list[tuple[int, int]]) -> list[slice]:
        """The blocks a slice overlaps, as an index of its scale tensor."""
        lead, (r0, r1), (c0, c1) = bounds[:-2], bounds[-2], bounds[-1]
        b0, b1 = self.quant.block
        blocks = [*lead, (r0 // b0, -(-r1 // b0)), (c0 // b1, -(-c1 // b1))]
        return [slice(a, b) for a, b in blocks]

    def read(
        self,
        name: str,
        index: Index = (),
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> Tensor:
        """Tensor `name`[index] (one slice per leading dim, step 1) as a fresh `dtype` tensor
        on `device`; FP8 weights are dequantized with their block scales (read in their own
        FP8 dtype, they are copied as stored)."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"missing: {name}")
        if name in self.int4:
            part = self.read_int4(name, index, device=device)
            out = torch.empty(
                *part.packed.shape[:-1],
                part.packed.shape[-1] * INT4_PACK,
                dtype=dtype,
                device=device,
            )
            return dequantize_int4(part.packed, part.scale, self.quant.group, out)
        bounds = _bounds(name, index, info.shape)
        sizes = [b - a for a, b in bounds]
        # Whole stored rows, not the slice's: reading some columns of a row faults in its
        # neighbouring pages too (the kernel maps pages around a fault), so a column slice
        # makes about the whole rows resident.
        row_bytes = math.prod(info.shape[1:]) * info.dtype.itemsize
        step = max(1, READ_CHUNK_BYTES // max(row_bytes, 1))
        if not bounds or sizes[0] <= step:
            return self._read_once(name, info, bounds, dtype, device)
        # A large slice goes in chunks of leading rows, the file closed after each, so the
        # mapped pages of at most one chunk are resident beside the result.
        out = torch.empty(sizes, dtype=dtype, device=device)
        first, last = bounds[0]
        for start in range(first, last, step):
            stop = min(start + step, last)
            chunk = [(start, stop), *bounds[1:]]
            self._read_once(name, info, chunk, dtype, device, out[start - first : stop - first])
        return out

    def _read_once(
        self,
        name: str,
        info: TensorInfo,
        bounds: list[tuple[int, int]],
        dtype: torch.dtype,
        device: torch.device | str,
        out: Tensor | None = None,
    ) -> Tensor:
        """The slice `bounds` of `name`, into `out` when given (copied straight from the
        mapped file: no second copy of a chunk)."""
        key = tuple(slice(a, b) for a, b in bounds)
        f = self._open(info.file)
        part = f.get_slice(name)[key] if key else f.get_tensor(name)
        if info.dtype not in FP8_DTYPES or dtype == info.dtype:
            result = (
                out.copy_(part)
                if out is not None
                else part.to(device=device, dtype=dtype, copy=True).contiguous()
            )
            del part
            self._account(info, bounds)
            return result
        w = part.to(device=device, copy=True)
        del part
        self._account(info, bounds)
        values = self._dequantize(name, w, bounds)
        return out.copy_(values) if out is not None else values.to(dtype).contiguous()

    def _open(self, path: Path) -> Any:
        if self._file != path:
            self.close()
            self._handle = safe_open(str(path), framework="pt")
            self._file = path
        return self._handle

    def _account(self, info: TensorInfo, bounds: list[tuple[int, int]]) -> None:
        """Count the stored bytes a read spanned (whole rows, see `read`); past the budget
        the file is closed, unmapping the pages the reads made resident. The slice's own
        stored bytes go to the meter."""
        if self._meter is not None:
            self._meter.add(math.prod(b - a for a, b in bounds) * info.dtype.itemsize)
        rows = bounds[0][1] - bounds[0][0] if bounds else 1
        self._touched += rows * math.prod(info.shape[1:]) * info.dtype.itemsize
        if self._touched >= READ_CHUNK_BYTES:
            self.close()

    def close(self) -> None:
        """Close the open file (dropping the mapping and the pages it made resident)."""
        self._handle, self._file, self._touched = None, None, 0

    def _dequantize(self, name: str, w: Tensor, bounds: list[tuple[int, int]]) -> Tensor:
        """w [..., rows, cols] (the slice `bounds` of `name`) times its blocks' scales."""
        (r0, r1), (c0, c1) = bounds[-2], bounds[-1]
        b0, b1 = self.quant.block
        scale = self.read(
            name + SCALE_SUFFIX, self._scale_index(bounds), dtype=torch.float32, device=w.device
        )
        # Blocks -> elements, then drop the part of the first block before the slice start.
        scale = scale.repeat_interleave(b0, dim=-2).repeat_interleave(b1, dim=-1)
        scale = scale[..., r0 % b0 : r0 % b0 + (r1 - r0), c0 % b1 : c0 % b1 + (c1 - c0)]
        return w.to(torch.float32) * scale


def _bounds(name: str, index: Index, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """[start, stop) per dimension (all of a dimension the index leaves out)."""
    if len(index) > len(shape):
        raise CheckpointError(f"{name}: {len(index)} slices for a {len(shape)}-d tensor")
    out = []
    for dim, size in enumerate(shape):
        s = index[dim] if dim < len(index) else slice(None)
        start, stop, step = s.indices(size)
        if step != 1 or stop < start:
            raise CheckpointError(f"{name}: slice {s} of dim {dim} is not contiguous")
        out.append((start, stop))
    return out
