"""A rank's step at its bucket: padding rows and a wider table change nothing real."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.parallel import ParallelConfig, ParallelMode
from common.runtime.kernel_choice import KernelConfig
from services.decode.config import EngineConfig
from services.decode.group.spec import group_spec
from services.decode.rank.runtime import RankRuntime
from services.decode.step_plan import DecodePlan, TableEdits
from tests.tiny import save_hf

BS = 4
LAYOUTS = {
    "mla-tp": ParallelConfig(tp=1),
    "sp": ParallelConfig(tp=1, mode=ParallelMode.SP, chunk_size=4),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("runtime-model")
    save_hf("v2-greedy", path, std=0.08)
    return path


def _runtime(model_dir: Path, layout: str, kernel: str) -> RankRuntime:
    cfg = EngineConfig(
        model=str(model_dir),
        parallel=LAYOUTS[layout],
        master_port=0,
        kv_budget_mb=1,
        block_size=BS,
        kernels=KernelConfig(decode_attention=kernel),
    )
    runtime = RankRuntime(cfg, 0, group_spec(cfg))
    usable = runtime.cache.usable_blocks * BS
    runtime.cache.kv[:, :usable].normal_(0.0, 0.5, generator=torch.Generator().manual_seed(0))
    return runtime


@pytest.mark.parametrize("kernel", ["torch", "native"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_padded_step_equals_the_unpadded_one(model_dir: Path, layout: str, kernel: str) -> None:
    positions = [13, 6, 21]
    tables = [[0, 1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11]]
    width = max(len(t) for t in tables)
    exact = torch.full((1, 3, width), -1, dtype=torch.int64)
    for row, t in enumerate(tables):
        exact[0, row, : len(t)] = torch.tensor(t)
    tokens = torch.tensor([5, 9, 17])
    rows = torch.arange(3)
    plain = DecodePlan(tokens, torch.tensor(positions), rows, width, TableEdits.whole(exact))
    one, two = _runtime(model_dir, layout, kernel), _runtime(model_dir, layout, kernel)
    # The bucket: 4 rows (one of padding: token 0, position 0, the all -1 row), 8 blocks.
    padded = DecodePlan(
        torch.tensor([5, 9, 17, 0]),
        torch.tensor([*positions, 0]),
        torch.tensor([0, 1, 2, two.tables.padding]),
        8,
        TableEdits.whole(exact),
    )
    want = one.step(plain)
    got = two.step(padded)
    assert got.shape[0] == 4
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    # Every real write landed in the same slot; the padding row's went to the trash block.
    usable = one.cache.usable_blocks * BS
    torch.testing.assert_close(two.cache.kv[:, :usable], one.cache.kv[:, :usable])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_counted_step_returns_a_count_that_no_layer_adds_to(tmp_path: Path, layout: str) -> None:
    """Dense models of 2 and 6 layers: the same count (the MoE's routing reads its expert
    counts on the host once a layer until it routes on the device)."""
    counts = []
    for layers in (2, 6):
        path = tmp_path / f"dense-{layers}"
        save_hf("v2-greedy", path, num_hidden_layers=layers, first_k_dense_replace=layers)
        runtime = _runtime(path, layout, "torch")
        tables = TableEdits.whole(torch.tensor([[[0, 1, -1, -1], [2, -1, -1, -1]]]))
        plan = DecodePlan(
            torch.tensor([3, 4]), torch.tensor([5, 2]), torch.arange(2), 4, tables, True
        )
        out = runtime.step(plan)
        assert out.shape[0] == 3
        counts.append(int(out[2, 0]))
    assert counts == [0, 0]
