"""The Triton FP8 block-scaled grouped GEMM against its reference (both operands dequantized
to fp32, one matmul per group).

Without CUDA the kernel runs under Triton's interpreter (tests/conftest.py imports triton in
that mode; the `triton_interpret` fixture sets TRITON_INTERPRET per test); with CUDA the same
cases run compiled. The products of e4m3 values are exact in fp32 on both paths, so the
kernel differs from the reference only by the order of its fp32 sums (and, in a 16-bit
output, the one rounding of each sum).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.language")

from common.model.fp8_gemm import quantize_groups
from common.triton_kernels import fp8_blocks
from common.triton_kernels.fp8_blocks import BlockFp8
from common.triton_kernels.fp8_grouped_gemm import fp8_grouped_mm, fp8_grouped_mm_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROOT = Path(__file__).resolve().parents[4]
# Relative to the output's largest magnitude: fp32 sums in another order; a 16-bit output
# rounded once (bf16 keeps 8 bits).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}

pytestmark = pytest.mark.usefixtures("triton_interpret")


def weights(
    groups: int, n: int, k: int, block: tuple[int, int] = (128, 128), row_offset: int = 0
) -> BlockFp8:
    """Random e4m3 values and block scales; rows start `row_offset` into their first block."""
    g = torch.Generator().manual_seed(groups * n + k)
    values = (torch.randn(groups, n, k, generator=g) * 64).clamp(-448, 448)
    scale_rows = (row_offset + torch.arange(n)) // block[0]
    cols = math.ceil(k / block[1])
    scale = torch.rand(groups, int(scale_rows[-1]) + 1, cols, generator=g) * 1e-3 + 1e-4
    scale_cols = (128 * torch.arange(math.ceil(k / 128))) // block[1]
    return BlockFp8(
        values.to(torch.float8_e4m3fn).to(DEVICE),
        scale.to(DEVICE),
        scale_rows.int().to(DEVICE),
        scale_cols.int().to(DEVICE),
    )


def activations(rows: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4
    return quantize_groups(x.to(DEVICE))


def check(got: torch.Tensor, want: torch.Tensor, held: int, dtype: torch.dtype) -> None:
    got, want = got[:held].float(), want[:held].float()
    assert torch.isfinite(got).all()
    err = float((got - want).abs().max()) if held else 0.0
    assert err <= TOLERANCE[dtype] * max(float(want.abs().max()), 1e-6), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("n", "k", "ends"),
    [
        (256, 256, [3, 3, 9, 20]),  # an empty group, ragged rows
        (192, 320, [0, 40, 41, 41]),  # a partial N tile and K group; empty first and last
        (128, 128, [17]),  # one group: a dense linear's rows
    ],
)
def test_gathered_rows_equal_the_reference(
    n: int, k: int, ends: list[int], dtype: torch.dtype
) -> None:
    w = weights(len(ends), n, k)
    a, a_scale = activations(13, k)
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 13, (ends[-1] + 5,), generator=g).int().to(DEVICE)  # 5 unheld
    end = torch.tensor(ends, dtype=torch.int32, device=DEVICE)
    got = fp8_grouped_mm(a, a_scale, end, w, dtype, rows)
    assert got.shape == (ends[-1] + 5, n) and got.dtype == dtype
    check(got, fp8_grouped_mm_reference(a, a_scale, end, w, dtype, rows), ends[-1], dtype)


@pytest.mark.parametrize("case", ["mid-block rows", "256-column blocks", "many rows"])
def test_own_rows_and_other_block_layouts(case: str) -> None:
    if case == "mid-block rows":  # gate then up rows of a slice from inside a block
        w, rows = weights(3, 96, 192, row_offset=96), 30
    elif case == "256-column blocks":  # two activation groups per weight scale column
        w, rows = weights(2, 128, 512, block=(128, 256)), 30
    else:  # 64-row tiles, several programs per group (M splits)
        w, rows = weights(2, 128, 128), 300
    a, a_scale = activations(rows, w.values.shape[2], seed=2)
    groups = w.values.shape[0]
    end = torch.tensor(
        [rows * (e + 1) // groups for e in range(groups)], dtype=torch.int32, device=DEVICE
    )
    got = fp8_grouped_mm(a, a_scale, end, w, torch.float32)
    check(got, fp8_grouped_mm_reference(a, a_scale, end, w, torch.float32), rows, torch.float32)


def test_bad_inputs_are_named() -> None:
    w = weights(2, 128, 128)
    a, a_scale = activations(4, 128)
    end = torch.tensor([2, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_grouped_mm(a.float(), a_scale, end, w, torch.float32)
    with pytest.raises(ValueError, match="ends"):
        fp8_grouped_mm(a, a_scale, end.long(), w, torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_grouped_mm(a, a_scale, end, w, torch.float64)
    empty = fp8_grouped_mm(a[:0], a_scale[:0], end * 0, w, torch.float32)
    assert empty.shape == (0, 128)


def test_the_cpu_without_the_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert fp8_blocks.unsupported(cpu) is None  # the interpreter, as these tests run it
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET" in (fp8_blocks.unsupported(cpu) or "")
    w = weights(1, 128, 128)
    a, a_scale = activations(2, 128)
    end = torch.tensor([2], dtype=torch.int32)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            fp8_grouped_mm(a, a_scale, end, w, torch.float32)


# Runs in a subprocess without TRITON_INTERPRET (this session's triton is the interpreter's):
# argv[1] is the JSON list of cells, each (n, k, rows, groups, out dtype, gather, *rest);
# argv[2] the compile call, of those names, `arch` and `tiles`; argv[3] the architecture.
_COMPILE = """
import json, sys
from dataclasses import asdict
import torch
try:
    from triton.backends.nvidia.compiler import get_ptxas
    get_ptxas(90).path
except Exception as e:
    print(json.dumps({"skip": f"triton's ptxas is not available: {e}"}))
    sys.exit(0)
from common.triton_kernels.compile import compile_fp8_grouped_gemm, compile_int4_grouped_gemm
from common.triton_kernels.grouped_gemm import choose_tiles
dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
rows = []
for n, k, slots, groups, dtype, gather, *rest in json.loads(sys.argv[1]):
    arch = int(sys.argv[3])
    tiles = choose_tiles(slots, groups, 64 if arch >= 90 else 32)  # as max_block_m says
    info = eval(sys.argv[2])
    rows.append({"block_m": tiles.block_m, **asdict(info)})
print(json.dumps({"rows": rows}))
"""


# The most shared memory one block may use: an H100 / H200's, an A100's.
MAX_SHARED = {90: 227 * 1024, 80: 163 * 1024}


def check_compiles(cells: list[tuple[object, ...]], call: str, arch: int = 90) -> None:
    """Compile the grouped GEMM for sm_`arch` at each cell (`call`: _COMPILE's) in a
    subprocess; every compile fits the architecture without spilling, on its tensor cores
    (sm_90: wgmma at 64-row tiles, else mma.sync; sm_80: mma.sync)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps(cells), call, str(arch)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    lines = []
    for cell, info in zip(cells, result["rows"], strict=True):
        assert info["name"] == "_grouped_gemm_kernel" and info["arch"] == arch
        assert 0 < info["registers"] <= 255 and info["spill_stores"] == 0
        assert info["shared"] <= MAX_SHARED[arch]
        wgmma = arch == 90 and info["block_m"] == 64
        assert info["tensor_cores"] == ("wgmma" if wgmma else "mma.sync")
        lines.append(f"{cell} block_m={info['block_m']} {info}")
    print("\n" + "\n".join(lines))


def test_the_kernel_compiles_for_sm90_at_v3_expert_shapes() -> None:
    """DeepSeek-V3's experts (hidden 7168, intermediate 2048) as an ep = 8 rank holds them (32
    whole experts) and as a tp = 8 rank does (256 experts, 256 columns each), both
    projections, a decode step's rows (16- and 32-row tiles on mma.sync) and an 8K-token
    prefill chunk's (64-row tiles on wgmma): every compile fits sm_90 without spilling."""
    cells: list[tuple[object, ...]] = [
        # (N, K, rows, groups, output, gather): ep = 8 at decode batch 128 (gate_up, which
        # gathers each row's token) and an 8K prefill chunk's held slots (down).
        (4096, 7168, 128 * 8, 32, "bf16", True),
        (7168, 2048, 8192, 32, "bf16", False),
        # tp = 8 at decode batch 1 and 32, and an 8K prefill chunk in fp32.
        (512, 7168, 8, 256, "bf16", True),
        (7168, 256, 32 * 8, 256, "bf16", False),
        (7168, 256, 8192 * 8, 256, "fp32", False),
    ]
    check_compiles(cells, "compile_fp8_grouped_gemm(arch, n, k, tiles, dtypes[dtype], gather)")
