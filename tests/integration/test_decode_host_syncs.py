"""`tpla bench decode-step`'s host_syncs_per_step on real tp = 2 groups: the torch kernel's
step waits for the device at most twice on any rank (the sampled tokens' one transfer
included), however many layers the model has."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny import save_hf
from tools.bench.decode_step import measure


@pytest.mark.parametrize("layout", ["tpla", "sp"])
def test_host_syncs_do_not_grow_with_layers(tmp_path: Path, layout: str) -> None:
    counts = []
    for layers in (2, 6):
        # Dense layers: the MoE's routing still reads its expert counts on the host.
        path = tmp_path / f"dense-{layers}"
        save_hf("v2-greedy", path, num_hidden_layers=layers, first_k_dense_replace=layers)
        rows = measure(
            str(path), layout, 2, 2 if layout == "tpla" else 1, [3], 24, 3, None, kernel="torch"
        )
        counts.append(rows[0].host_syncs_per_step)
    assert counts[0] == counts[1] <= 2
