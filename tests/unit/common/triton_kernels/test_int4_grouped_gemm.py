"""The Triton W4A16 grouped GEMM against its reference (the weights dequantized by
`dequantize_int4` in the activations' dtype, one fp32 matmul per group).

Without CUDA the kernel runs under Triton's interpreter (tests/conftest.py); with CUDA the
same cases run compiled. The kernel's weights are bit for bit the dequantized ones, so it
differs from the reference only by the order of its fp32 sums (and, in a 16-bit output, the
one rounding of each sum): an fp32 output is held to 1e-5 of its largest magnitude whatever
the activations' dtype.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.language")

from common.triton_kernels.int4_grouped_gemm import int4_grouped_mm, int4_grouped_mm_reference
from tests.tiny_families import pack_int4
from tests.unit.common.triton_kernels.test_fp8_grouped_gemm import TOLERANCE, check, check_compiles

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

pytestmark = pytest.mark.usefixtures("triton_interpret")


def weights(
    groups: int, n: int, k: int, group: int, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random INT4 experts as compressed-tensors packs them: words [E, N, K / 8], scales."""
    g = torch.Generator().manual_seed(groups * n + k)
    parts = [pack_int4(torch.randn(n, k, generator=g), group) for _ in range(groups)]
    packed = torch.stack([p[0] for p in parts]).to(DEVICE)
    scale = torch.stack([p[1] for p in parts]).to(scale_dtype)
    if scale_dtype == torch.float32:  # off the bf16 grid: the kernel rounds it as dequantize_int4
        scale = scale * 1.37
    return packed, scale.to(DEVICE)


def activations(rows: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=g) * 2).to(DEVICE, dtype)


@pytest.mark.parametrize(
    ("dtype", "out_dtype", "scale_dtype"),
    [
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),  # Kimi's: bf16 everywhere
        (torch.bfloat16, torch.float32, torch.float32),  # every product visible in fp32
        (torch.float32, torch.float32, torch.bfloat16),  # the CPU's serving dtype
    ],
)
@pytest.mark.parametrize(
    ("n", "k", "group", "ends"),
    [
        (160, 192, 32, [3, 3, 9, 20]),  # an empty group, ragged rows; partial N and K tiles
        (128, 128, 16, [0, 17]),  # an empty first group, a smaller scale group
        (64, 256, 128, [9]),  # one group: a dense linear's rows; scales over two K steps
    ],
)
def test_gathered_rows_equal_the_reference(
    n: int,
    k: int,
    group: int,
    ends: list[int],
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    scale_dtype: torch.dtype,
) -> None:
    packed, scale = weights(len(ends), n, k, group, scale_dtype)
    a = activations(13, k, dtype)
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 13, (ends[-1] + 5,), generator=g).int().to(DEVICE)  # 5 unheld
    end = torch.tensor(ends, dtype=torch.int32, device=DEVICE)
    got = int4_grouped_mm(a, end, packed, scale, group, out_dtype, rows)
    assert got.shape == (ends[-1] + 5, n) and got.dtype == out_dtype
    want = int4_grouped_mm_reference(a, end, packed, scale, group, out_dtype, rows)
    check(got, want, ends[-1], out_dtype)


def test_own_rows_over_several_tiles() -> None:
    """64-row tiles, several programs per group (M splits), no gather, an fp16 output."""
    packed, scale = weights(2, 128, 64, 32)
    a = activations(300, 64, torch.bfloat16, seed=2)
    end = torch.tensor([150, 300], dtype=torch.int32, device=DEVICE)
    got = int4_grouped_mm(a, end, packed, scale, 32, torch.float16)
    want = int4_grouped_mm_reference(a, end, packed, scale, 32, torch.float16)
    check(got, want, 300, torch.float16)
    assert TOLERANCE[torch.float16] < TOLERANCE[torch.bfloat16]


def test_bad_inputs_are_named() -> None:
    packed, scale = weights(2, 64, 64, 32)
    a = activations(4, 64, torch.bfloat16)
    end = torch.tensor([2, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="fp32 / bf16 / fp16"):
        int4_grouped_mm(a.double(), end, packed, scale, 32, torch.float32)
    with pytest.raises(ValueError, match="scale must be"):
        int4_grouped_mm(a, end, packed, scale, 16, torch.float32)
    with pytest.raises(ValueError, match="packed must be"):
        int4_grouped_mm(a, end, packed.long(), scale, 32, torch.float32)
    with pytest.raises(ValueError, match="ends"):
        int4_grouped_mm(a, end.long(), packed, scale, 32, torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        int4_grouped_mm(a, end, packed, scale, 32, torch.float64)
    assert int4_grouped_mm(a[:0], end * 0, packed, scale, 32, torch.float32).shape == (0, 64)


CALL = (
    "compile_int4_grouped_gemm(arch, n, k, rest[0], tiles, dtypes[rest[1]], dtypes[dtype], gather)"
)


def test_the_kernel_compiles_for_sm90_at_kimi_expert_shapes() -> None:
    """Kimi K2's INT4 experts (hidden 7168, intermediate 2048, group 32, bf16) as an ep = 8
    rank holds them (48 of 384) and as a tp = 8 rank does (384 experts, 256 columns each),
    both projections, a decode step's rows and an 8K-token prefill chunk's: every compile
    fits sm_90 without spilling, on the tensor cores."""
    cells: list[tuple[object, ...]] = [
        # (N, K, rows, groups, output, gather, group, activations)
        (4096, 7168, 128 * 8, 48, "bf16", True, 32, "bf16"),
        (7168, 2048, 8192 * 8, 48, "bf16", False, 32, "bf16"),
        (512, 7168, 8, 384, "bf16", True, 32, "bf16"),
        (7168, 256, 32 * 8, 384, "fp32", False, 32, "bf16"),
    ]
    check_compiles(cells, CALL)


def test_the_kernel_compiles_for_sm80() -> None:
    """W4A16 needs no FP8 tensor cores: on an A100 (sm_80) the kernel compiles for a decode
    step's rows and an 8K-token prefill chunk's, on mma.sync without spilling, which is why
    `triton` is offered from sm_80 (common/model/experts_kernel.py)."""
    cells: list[tuple[object, ...]] = [
        (4096, 7168, 128 * 8, 48, "bf16", True, 32, "bf16"),
        (7168, 2048, 8192 * 8, 48, "bf16", False, 32, "bf16"),
    ]
    check_compiles(cells, CALL, arch=80)
