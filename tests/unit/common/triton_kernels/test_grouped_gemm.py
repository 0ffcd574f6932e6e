"""The tile loop both Triton grouped GEMMs share: its tiles follow the rows per group (the
kernels themselves: test_fp8_grouped_gemm.py, test_int4_grouped_gemm.py)."""

from __future__ import annotations

import torch

from common.triton_kernels import grouped_gemm
from common.triton_kernels.grouped_gemm import Tiles, choose_tiles


def test_tiles_follow_the_rows_per_group() -> None:
    assert choose_tiles(8, 256) == Tiles(16, 1, 4)  # a decode step: few rows
    assert choose_tiles(1024, 32) == Tiles(32, 1, 4)
    tiles = choose_tiles(65536, 32)  # an 8K-token prefill chunk over 32 experts
    assert tiles.block_m == 64 and tiles.num_warps == 8 and tiles.m_splits == 32
    assert choose_tiles(10**7, 1).m_splits == grouped_gemm.MAX_M_SPLITS
    assert choose_tiles(0, 4).block_m == 16
    # Before sm_90 (mma.sync) 32-row tiles at most: 64 rows at 8 warps spill there.
    assert choose_tiles(65536, 32, max_block_m=32) == Tiles(32, 64, 4)
    assert grouped_gemm.max_block_m(torch.device("cpu")) == 64
