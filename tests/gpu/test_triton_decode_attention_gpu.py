"""The Triton decode-attention kernel compiled for this GPU against its reference, at the
engine's real shapes and context lengths (run by `pytest -m gpu` where CUDA exists)."""

from __future__ import annotations

import math

import pytest
import torch

# tests/conftest.py has imported triton in this machine's mode (compiled with CUDA).
from common.triton_kernels import decode_attention, triton_mode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not triton_mode.triton_installed(), reason="needs triton"),
]

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}


def _case(lengths, heads, width, rope, block_size, dtype, seed=0):
    """Shuffled pool blocks, table entries past each sequence set to -1, on cuda:0."""
    g = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in lengths]
    pool = sum(needed) + 5
    order = torch.randperm(pool, generator=g)
    block_ids = torch.full((len(lengths), max(needed) + 1), -1, dtype=torch.int64)
    start = 0
    for b, count in enumerate(needed):
        block_ids[b, :count] = order[start : start + count]
        start += count
    kv = torch.randn(pool * block_size, width + rope, generator=g)
    q = torch.randn(len(lengths), heads, width + rope, generator=g) * 2 / math.sqrt(width + rope)
    cuda = torch.device("cuda")
    return (
        q.to(cuda, dtype),
        kv.to(cuda, dtype),
        block_ids.to(cuda),
        torch.tensor(lengths, device=cuda),
        block_size,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [None, 1, 8])
@pytest.mark.parametrize(
    ("heads", "width", "rope", "block_size"),
    [
        (128, 512, 64, 64),  # DeepSeek-V3, one rank (MLA)
        (64, 512, 64, 16),  # V3 MLA-TP at tp = 2
        (128, 256, 64, 16),  # V3 TPLA r = 2
        (64, 128, 64, 64),  # V3 TPLA r = 4, tp = 8
        (8, 64, 16, 16),  # demo TPLA r = 2
    ],
)
def test_kernel_matches_reference_on_cuda(heads, width, rope, block_size, dtype, splits) -> None:
    lengths = [0, 1, 17, 300, 1000, 4099]
    q, kv, ids, lens, bs = _case(lengths, heads, width, rope, block_size, dtype)
    u, lse = decode_attention.paged_decode_attention(q, kv, ids, lens, bs, splits, rope_width=rope)
    ref_u, ref_lse = decode_attention.paged_decode_attention_reference(
        q, kv, ids, lens, bs, rope_width=rope
    )
    assert torch.isfinite(u).all() and not u[0].any()
    assert torch.isinf(lse[0]).all()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(u.float(), ref_u.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse[1:], ref_lse[1:], atol=1e-4, rtol=1e-5)


def test_int32_tables_and_lengths() -> None:
    q, kv, ids, lens, bs = _case([5, 70, 513], 16, 512, 64, 16, torch.bfloat16, seed=1)
    u, lse = decode_attention.paged_decode_attention(
        q, kv, ids.int(), lens.int(), bs, 4, rope_width=64
    )
    ref_u, ref_lse = decode_attention.paged_decode_attention_reference(
        q, kv, ids, lens, bs, rope_width=64
    )
    torch.testing.assert_close(u.float(), ref_u.float(), atol=1.5e-2, rtol=1.5e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
