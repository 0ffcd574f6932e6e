"""compressed-tensors' pack-quantized INT4 (common/triton_kernels/int4_packing.py): the
unpacking is the packing undone, and the one dequantization rounds once in its dtype."""

from __future__ import annotations

import torch

from common.triton_kernels.int4_packing import dequantize_int4, unpack_int4
from tests.tiny_families import pack_int4


def test_unpack_undoes_the_packing() -> None:
    q = torch.randint(-8, 8, (3, 32), generator=torch.Generator().manual_seed(0))
    words = (
        (q + 8).view(3, 4, 8).to(torch.int32) << torch.arange(0, 32, 4, dtype=torch.int32)
    ).sum(-1, dtype=torch.int32)
    assert torch.equal(unpack_int4(words), q.to(torch.int8))


def test_bfloat16_dequantization_rounds_once() -> None:
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(2))
    words, scale, expected = pack_int4(w, 16)
    out = torch.empty(6, 64, dtype=torch.bfloat16)
    assert torch.equal(dequantize_int4(words, scale, 16, out), expected.to(torch.bfloat16))
