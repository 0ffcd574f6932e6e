"""INT4-resident weights (common/model/int4.py): the unpacking is compressed-tensors'
packing undone, dequantize-on-use equals the values the checkpoint means, and the weights of
one role share one workspace buffer."""

from __future__ import annotations

import torch

from common.model.fp8 import dense, share_workspace
from common.model.int4 import Int4Weight, dequantize_int4, unpack_int4
from tests.tiny_families import pack_int4


def _weight(
    seed: int, rows: int = 6, cols: int = 64, group: int = 16
) -> tuple[Int4Weight, torch.Tensor]:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    words, scale, dq = pack_int4(w, group)
    return Int4Weight(words, scale, group, torch.float32, "experts.down_proj"), dq


def test_unpack_undoes_the_packing() -> None:
    q = torch.randint(-8, 8, (3, 32), generator=torch.Generator().manual_seed(0))
    words = (
        (q + 8).view(3, 4, 8).to(torch.int32) << torch.arange(0, 32, 4, dtype=torch.int32)
    ).sum(-1, dtype=torch.int32)
    assert torch.equal(unpack_int4(words), q.to(torch.int8))


def test_dequantize_on_use_is_the_checkpoints_values() -> None:
    weight, expected = _weight(1)
    assert weight.shape == expected.shape
    assert torch.equal(dense(weight), expected)
    stacked = Int4Weight(
        weight.packed[None].repeat(3, 1, 1),
        weight.scale[None].repeat(3, 1, 1),
        16,
        torch.float32,
        "r",
    )
    assert torch.equal(stacked.dequantize(), expected.expand(3, -1, -1))
    x = torch.randn(2, 64)
    torch.testing.assert_close(weight(x), x @ expected.T)


def test_bfloat16_dequantization_rounds_once() -> None:
    weight, expected = _weight(2)
    out = torch.empty(weight.shape, dtype=torch.bfloat16)
    assert torch.equal(
        dequantize_int4(weight.packed, weight.scale, 16, out), expected.to(torch.bfloat16)
    )


def test_weights_of_one_role_share_a_buffer() -> None:
    a, b = _weight(3)[0], _weight(4)[0]
    model = torch.nn.ModuleList([a, b])
    share_workspace(model)
    first = a.dequantize()
    assert b.dequantize().data_ptr() == first.data_ptr()  # bounded: one buffer per role
    assert a.nbytes < 64 * 6 * 4 / 4  # words and scales: about half a byte a value
