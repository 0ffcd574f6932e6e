"""Ahead-of-time compilation of the Triton kernels for a CUDA target, on any machine: the
decode-attention kernels (`compile_for`) and the grouped GEMMs, FP8
(`compile_fp8_grouped_gemm`) or W4A16 (`compile_int4_grouped_gemm`).

`triton.compile` lowers a kernel to PTX and runs the ptxas that the triton wheel ships, so
the Triton -> PTX -> cubin path for sm_80 / sm_90 is checked on a CPU-only machine. Register
and spill counts are what ptxas reports for the cubin (`ptxas -v`, re-run on the compiled
PTX with Triton's own flags), since Triton reads them only when a GPU loads the binary;
shared memory is Triton's own figure (`metadata.shared`, the dynamic shared memory a launch
reserves). Written against triton 3.9's `ASTSource` / `compile` API.
"""

from __future__ import annotations

import functools
import math
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.triton_kernels.decode_attention import (
    MERGE_STAGES,
    MERGE_WARPS,
    choose_tiles,
    dot_precision,
    kernels,
)
from common.triton_kernels.fp8_blocks import GROUP
from common.triton_kernels.fp8_grouped_gemm import block_step
from common.triton_kernels.grouped_gemm import BLOCK_N, NUM_STAGES, Tiles, tile_loop
from common.triton_kernels.int4_grouped_gemm import INT4_BLOCK_K, group_step
from common.triton_kernels.triton_mode import interpreted_import, triton_installed

TYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
INDEX_NAMES = {torch.int32: "i32", torch.int64: "i64"}
# Stands for a runtime int the JIT does not specialize on (not 1, not a multiple of 16).
GENERIC_INT = 3


@dataclass(frozen=True)
class CompiledKernelInfo:
    """Resources of one compiled kernel (bytes unless named otherwise)."""

    name: str
    arch: int  # compute capability, 80 or 90
    registers: int  # per thread
    spill_stores: int
    spill_loads: int
    stack_frame: int
    shared: int
    num_warps: int
    num_stages: int
    tensor_cores: str  # tensor-core instructions in the PTX: "wgmma", "mma.sync" or "none"


def _int_arg(value: int) -> tuple[str, list[list[Any]] | None]:
    """The JIT's specialization of an int argument: 1 becomes a constant, multiples of 16
    carry a divisibility hint (so AOT builds the binary a launch with `value` would get)."""
    if value == 1:
        return "constexpr", None
    return "i32", [["tt.divisibility", 16]] if value % 16 == 0 else []


def _source(fn: Any, args: list[tuple[str, str | int]], constants: dict[str, Any]) -> Any:
    """An ASTSource for `fn`: args are (name, pointer type) or (name, sample int value)."""
    from triton.compiler import ASTSource

    signature: dict[str, str] = {}
    constexprs = dict(constants)
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for index, (name, kind) in enumerate(args):
        if isinstance(kind, str):  # a pointer: torch's allocations are 16-byte aligned
            signature[name], attr = kind, [["tt.divisibility", 16]]
        else:
            signature[name], attr = _int_arg(kind)
            if attr is None:
                constexprs[name] = kind
        if attr:
            attrs[(index,)] = attr
    signature.update({name: "constexpr" for name in constants})
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


@functools.cache
def _ptxas_resources(ptx: str, arch: int) -> dict[str, int]:
    """Registers, spills and stack frame of the kernel in `ptx`, from `ptxas -v`."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        cmd = [get_ptxas(arch).path, "-v", "-lineinfo", "--regAllocOptLevel=2"]
        cmd += [f"--gpu-name={sm_arch_from_capability(arch)}", str(src), "-o", f"{src}.o"]
        log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    found = {
        "registers": re.search(r"Used (\d+) registers", log),
        "stack_frame": re.search(r"(\d+) bytes stack frame", log),
        "spill_stores": re.search(r"(\d+) bytes spill stores", log),
        "spill_loads": re.search(r"(\d+) bytes spill loads", log),
    }
    missing = [key for key, match in found.items() if match is None]
    if missing:
        raise RuntimeError(f"ptxas -v did not report {missing}:\n{log}")
    return {key: int(match.group(1)) for key, match in found.items() if match is not None}


def _tensor_cores(ptx: str) -> str:
    """What tl.dot became: Hopper's wgmma needs 64-row tiles (BLOCK_H >= 64 heads, BLOCK_M
    = 64 rows), smaller tiles use mma.sync, fp32 "ieee" dots (and the merge, which has none)
    use plain FMAs."""
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    return "mma.sync" if "mma.sync" in ptx else "none"


def _compile(src: Any, arch: int, num_warps: int, num_stages: int) -> CompiledKernelInfo:
    import triton
    from triton.backends.compiler import GPUTarget

    options = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True}
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    return CompiledKernelInfo(
        name=kernel.name,
        arch=arch,
        shared=int(kernel.metadata.shared),
        num_warps=num_warps,
        num_stages=num_stages,
        tensor_cores=_tensor_cores(kernel.asm["ptx"]),
        **_ptxas_resources(kernel.asm["ptx"], arch),
    )


def compile_for(
    target_arch: int,
    heads: int,
    latent_width: int,
    rope_width: int,
    block_size: int,
    dtype: torch.dtype,
    index_dtype: torch.dtype = torch.int64,
) -> list[CompiledKernelInfo]:
    """Compile both stages of `paged_decode_attention` for sm_`target_arch` as a launch with
    `heads` query heads, W = `latent_width`, R = `rope_width`, `block_size`, `dtype` cache
    and `index_dtype` block tables would, without a GPU. Raises on a failed compile."""
    if dtype not in TYPE_NAMES or index_dtype not in INDEX_NAMES:
        raise ValueError(f"unsupported dtypes {dtype}, {index_dtype}")
    _check_compilable()
    split_kv, merge = kernels()
    tiles = choose_tiles(heads, latent_width, rope_width, dtype)
    t, ix = f"*{TYPE_NAMES[dtype]}", f"*{INDEX_NAMES[index_dtype]}"
    stage1 = _source(
        split_kv,
        [
            ("Q", t),
            ("KV", t),
            ("BlockIds", ix),
            ("Lengths", "*i64"),
            ("PartO", "*fp32"),
            ("PartLse", "*fp32"),
            ("num_heads", heads),
            ("max_blocks", GENERIC_INT),
            ("stride_kv", latent_width + rope_width),
            ("stride_bt", GENERIC_INT),
        ],
        {
            "W": latent_width,
            "R": rope_width,
            "BLOCK_SIZE": block_size,
            "BLOCK_H": tiles.block_h,
            "BLOCK_N": tiles.block_n,
            "BLOCK_W": tiles.block_w,
            "BLOCK_R": tiles.block_r,
            "DOT_PRECISION": dot_precision(dtype),
            "BF16_AS_FP32": False,
        },
    )
    stage2 = _source(
        merge,
        [
            ("PartO", "*fp32"),
            ("PartLse", "*fp32"),
            ("U", t),
            ("Lse", "*fp32"),
            ("num_splits", GENERIC_INT),
        ],
        {"W": latent_width, "BLOCK_W": tiles.block_w},
    )
    return [
        _compile(stage1, target_arch, tiles.num_warps, tiles.num_stages),
        _compile(stage2, target_arch, MERGE_WARPS, MERGE_STAGES),
    ]


def _check_compilable() -> None:
    if not triton_installed():
        raise RuntimeError("compiling the Triton kernels needs triton (pip install triton)")
    if interpreted_import():
        raise RuntimeError(
            "triton was imported under TRITON_INTERPRET=1: compile in a process without it"
        )


def _grouped_gemm_source(
    step: Any,
    types: dict[str, str],
    strides: dict[str, int],
    n: int,
    k: int,
    tiles: Tiles,
    out_dtype: torch.dtype,
    gather: bool,
    block_k: int,
    scale_group: int,
) -> Any:
    """The shared tile loop over `step` as a launch with these pointer `types` (A, AScale,
    W, WScale) and sample `strides` (the ones the format decides) would build it."""
    if out_dtype not in TYPE_NAMES:
        raise ValueError(f"unsupported output dtype {out_dtype}")
    _check_compilable()
    pointers = [
        ("A", types["A"]),
        ("AScale", types["AScale"]),
        ("Rows", "*i32"),
        ("W", types["W"]),
        ("WScale", types["WScale"]),
        ("WScaleRows", "*i32"),
        ("WScaleCols", "*i32"),
        ("Ends", "*i32"),
        ("Out", f"*{TYPE_NAMES[out_dtype]}"),
    ]
    ints = [("N", n), ("K", k), *strides.items(), ("stride_out", n)]
    constants = {
        "GATHER": gather,
        "STEP": step,
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": BLOCK_N,
        "BLOCK_K": block_k,
        "AS_FP32": False,
        "SCALE_GROUP": scale_group,
    }
    return _source(tile_loop(), [*pointers, *ints], constants)


def compile_fp8_grouped_gemm(
    target_arch: int, n: int, k: int, tiles: Tiles, out_dtype: torch.dtype, gather: bool
) -> CompiledKernelInfo:
    """Compile `fp8_grouped_mm`'s kernel for sm_`target_arch` as a launch over groups of
    [n, k] weights with `tiles` (`choose_tiles`), an `out_dtype` output and, with `gather`,
    each row's activation row read from `rows` would, without a GPU. Raises on a failed
    compile."""
    groups = math.ceil(k / GROUP)
    types = {"A": "*fp8e4nv", "AScale": "*fp32", "W": "*fp8e4nv", "WScale": "*fp32"}
    strides = {
        "stride_a": k,
        "stride_as_m": 1,  # quantize_groups' scales are column-major
        "stride_as_k": GENERIC_INT,
        "stride_we": n * k,
        "stride_wn": k,
        "stride_se": GENERIC_INT,
        "stride_sr": groups,
        "stride_sc": 1,
    }
    src = _grouped_gemm_source(
        block_step(), types, strides, n, k, tiles, out_dtype, gather, GROUP, 1
    )
    return _compile(src, target_arch, tiles.num_warps, NUM_STAGES)


def compile_int4_grouped_gemm(
    target_arch: int,
    n: int,
    k: int,
    group: int,
    tiles: Tiles,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    gather: bool,
) -> CompiledKernelInfo:
    """Compile `int4_grouped_mm`'s kernel for sm_`target_arch` as a launch over groups of
    [n, k] INT4 weights with bf16 scales every `group` columns, `dtype` activations, `tiles`,
    an `out_dtype` output and, with `gather`, each row's activation row read from `rows`
    would, without a GPU. Raises on a failed compile."""
    if dtype not in TYPE_NAMES:
        raise ValueError(f"unsupported activation dtype {dtype}")
    t = f"*{TYPE_NAMES[dtype]}"
    # A stands in for the activation scales it does not have (never read).
    types = {"A": t, "AScale": t, "W": "*i32", "WScale": "*bf16"}
    strides = {
        "stride_a": k,
        "stride_as_m": k,
        "stride_as_k": 1,
        "stride_we": n * k // 8,
        "stride_wn": k // 8,
        "stride_se": n * k // group,
        "stride_sr": k // group,
        "stride_sc": 1,
    }
    src = _grouped_gemm_source(
        group_step(), types, strides, n, k, tiles, out_dtype, gather, INT4_BLOCK_K, group
    )
    return _compile(src, target_arch, tiles.num_warps, NUM_STAGES)
