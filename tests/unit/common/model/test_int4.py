"""INT4-resident weights (common/model/int4.py): dequantize-on-use equals the values the
checkpoint means, the weights of one role share one workspace buffer, and stacked experts
dequantize a bounded group at a time."""

from __future__ import annotations

import pytest
import torch

from common.model import experts
from common.model.expert_routing import route
from common.model.experts import experts_per_group, grouped_experts, routed_experts
from common.model.fp8 import dense, share_workspace
from common.model.int4 import Int4Weight
from tests.tiny_families import pack_int4


def _weight(
    seed: int, rows: int = 6, cols: int = 64, group: int = 16
) -> tuple[Int4Weight, torch.Tensor]:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    words, scale, dq = pack_int4(w, group)
    return Int4Weight(words, scale, group, torch.float32, "experts.down_proj"), dq


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


def test_weights_of_one_role_share_a_buffer() -> None:
    a, b = _weight(3)[0], _weight(4)[0]
    model = torch.nn.ModuleList([a, b])
    share_workspace(model)
    first = a.dequantize()
    assert b.dequantize().data_ptr() == first.data_ptr()  # bounded: one buffer per role
    assert a.nbytes < 64 * 6 * 4 / 4  # words and scales: about half a byte a value


def test_int4_experts_in_bounded_groups_equal_them_dequantized_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Kimi's INT4 routed experts run the grouped GEMMs a few experts at a time, as FP8's do:
    each group dequantized into one bounded buffer, the output that of the whole stack."""
    held, i, d = 4, 32, 64
    g = torch.Generator().manual_seed(5)

    def stacked(rows: int, cols: int, role: str) -> Int4Weight:
        words, scales = zip(
            *(pack_int4(torch.randn(rows, cols, generator=g), 16)[:2] for _ in range(held)),
            strict=True,
        )
        return Int4Weight(torch.stack(words), torch.stack(scales), 16, torch.float32, role)

    gate_up, down = stacked(2 * i, d, "gate_up"), stacked(d, i, "down")
    workspace = share_workspace(torch.nn.ModuleDict({"gate_up": gate_up, "down": down}))
    whole_up = gate_up.dequantize(out=torch.empty(gate_up.shape))
    whole_down = down.dequantize(out=torch.empty(down.shape))
    monkeypatch.setattr(experts, "DEQUANTIZED_BYTES", 3 * (2 * i * d + d * i) * 4)
    assert experts_per_group(gate_up, down) == 3  # a group of 3, then 1
    x = torch.randn(9, d, generator=g)
    ids = torch.stack([torch.randperm(held, generator=g)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=g)
    for kernel in (grouped_experts, routed_experts):
        want = kernel(x, route(ids, weights, held), whole_up, whole_down)
        got = kernel(x, route(ids, weights, held), gate_up, down)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    buffers = [b for key, b in workspace._buffers.items() if key[0] == "gate_up"]
    assert {b.shape[0] for b in buffers} == {3, 1}  # a group's, and the loop's one expert
