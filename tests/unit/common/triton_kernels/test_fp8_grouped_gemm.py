"""The Triton FP8 block-scaled grouped GEMM against its reference (both operands dequantized
to fp32, one matmul per group).

Without CUDA the kernel runs under Triton's interpreter (tests/conftest.py imports triton in
that mode; the `triton_interpret` fixture sets TRITON_INTERPRET per test); with CUDA the same
cases run compiled. The products of e4m3 values are exact in fp32 on both paths, so the
kernel differs from the reference only by the order of its fp32 sums (and, in a 16-bit
output, the one rounding of each sum).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton.language")

from common.model.fp8_gemm import quantize_groups
from common.triton_kernels import fp8_grouped_gemm
from common.triton_kernels.fp8_grouped_gemm import (
    BlockFp8,
    choose_tiles,
    fp8_grouped_mm,
    fp8_grouped_mm_reference,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
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


def test_tiles_follow_the_rows_per_group() -> None:
    assert choose_tiles(8, 256) == fp8_grouped_gemm.Tiles(16, 1, 4)  # a decode step: few rows
    assert choose_tiles(1024, 32) == fp8_grouped_gemm.Tiles(32, 1, 4)
    tiles = choose_tiles(65536, 32)  # an 8K-token prefill chunk over 32 experts
    assert tiles.block_m == 64 and tiles.num_warps == 8 and tiles.m_splits == 32
    assert choose_tiles(10**7, 1).m_splits == fp8_grouped_gemm.MAX_M_SPLITS
    assert choose_tiles(0, 4).block_m == 16


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
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w = weights(1, 128, 128)
    a, a_scale = activations(2, 128)
    end = torch.tensor([2], dtype=torch.int32)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            fp8_grouped_mm(a, a_scale, end, w, torch.float32)
