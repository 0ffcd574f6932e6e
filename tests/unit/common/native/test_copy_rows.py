"""The streaming row scatter (common/native/copy_rows) against `dest[index] = src`: exact
bytes for every row size and alignment, and the same refusals on both paths."""

from __future__ import annotations

import pytest
import torch

from common.native import copy_rows


def _bytes(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.int64).to(torch.uint8)


def _reference(dest: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    out = dest.clone()
    out[index] = src
    return out


needs_native = pytest.mark.skipif(not copy_rows.available(), reason="native library not built")


@needs_native
# Rows shorter than one 32-byte store, not a multiple of it, and large (a 16-token bf16 block
# of V2-Lite's 320-wide rows); offsets that leave the destination rows unaligned.
@pytest.mark.parametrize("row_bytes", [1, 7, 31, 32, 33, 100, 10240])
@pytest.mark.parametrize("offset", [0, 3, 16])
def test_native_scatter_writes_exactly_the_indexed_rows(row_bytes: int, offset: int) -> None:
    pool = _bytes(offset + 40 * row_bytes, seed=row_bytes)
    dest = pool[offset:].view(40, row_bytes)
    index = torch.randperm(40, generator=torch.Generator().manual_seed(offset))[:17]
    src = _bytes(17, row_bytes, seed=row_bytes + 1)
    want = _reference(dest, index, src)
    before = pool[:offset].clone()
    copy_rows.scatter_rows(dest, index, src)
    assert torch.equal(dest, want)
    assert torch.equal(pool[:offset], before)  # nothing written outside dest


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_scatter_keeps_every_bit_pattern(dtype: torch.dtype) -> None:
    # Random bytes viewed as floats: NaNs and denormals must move as bits.
    dest = _bytes(64, 16 * 80, seed=1).view(dtype).view(64, -1)
    src = _bytes(9, 16 * 80, seed=2).view(dtype).view(9, -1)
    index = torch.tensor([63, 0, 5, 6, 7, 40, 41, 2, 30])
    want = _reference(dest.view(torch.uint8), index, src.view(torch.uint8))
    copy_rows.scatter_rows(dest, index, src)
    assert torch.equal(dest.view(torch.uint8), want)


@pytest.mark.parametrize("bad", [[0, 40], [-1], [3, 2**40]])
@pytest.mark.parametrize("strided", [False, True], ids=["native", "fallback"])
def test_an_index_outside_dest_is_refused_and_nothing_is_written(
    bad: list[int], strided: bool
) -> None:
    # A strided destination takes the PyTorch path, which must refuse the same indices
    # (plain indexing would wrap -1 around to the last row).
    pool = _bytes(24, 40, seed=3).t() if strided else _bytes(40, 24, seed=3)
    before = pool.clone()
    index = torch.tensor(bad)
    with pytest.raises(IndexError, match="outside"):
        copy_rows.scatter_rows(pool, index, _bytes(len(bad), 24, seed=4))
    assert torch.equal(pool, before)


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="rows at"):
        copy_rows.scatter_rows(_bytes(4, 8, seed=0), torch.tensor([1, 2]), _bytes(2, 9, seed=1))


def test_the_fallback_takes_what_the_kernel_does_not() -> None:
    # A non-contiguous destination, another source dtype, int32 indices: PyTorch's indexed
    # copy (word views where they apply), same result as plain indexing.
    g = torch.Generator().manual_seed(5)
    dest = torch.randn(12, 20, generator=g).t()  # [20, 12], strided
    src = torch.randn(3, 12, generator=g, dtype=torch.float64)
    index = torch.tensor([4, 19, 0], dtype=torch.int32)
    want = _reference(dest, index.long(), src.float())
    copy_rows.scatter_rows(dest, index, src)
    assert torch.equal(dest, want)
    dest = torch.zeros(10, 8, dtype=torch.bfloat16)
    src = torch.randn(2, 8, generator=g).to(torch.bfloat16)
    want = _reference(dest, torch.tensor([7, 1]), src)
    copy_rows.scatter_rows(dest, torch.tensor([7, 1]), src)  # native or words: same bytes
    assert torch.equal(dest, want)


def test_an_empty_scatter_writes_nothing() -> None:
    dest = _bytes(5, 3, seed=6)
    before = dest.clone()
    copy_rows.scatter_rows(dest, torch.empty(0, dtype=torch.int64), _bytes(0, 3, seed=7))
    assert torch.equal(dest, before)
