"""`tpla bench capacity`'s formula: TPLA's saving of cache bytes per token against MLA-TP's."""

from __future__ import annotations

import pytest

from tools.bench.capacity import cache_shapes, expected_ratio, measure_capacity


def test_capacity_formula() -> None:
    assert expected_ratio(512, 64, 2) == pytest.approx(576 / 320)
    demo = cache_shapes()[0]
    rows = measure_capacity(demo, 64 * 2**20, (1, 2))
    assert rows[1]["ratio_vs_mla_tp"] == pytest.approx(144 / 80, rel=1e-3)
