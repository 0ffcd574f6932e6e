"""NCCL KV pairs beside the NCCL data group on one GPU (docs/design.md §5): a decode group of
two on GPUs 0 and 1 runs decode steps while shards prefilled on GPU 1 are pushed over the
torch transport again and again (rank 0's pair is NCCL from GPU 1 to GPU 0, created on its
receiver's pair thread; rank 1's is gloo, on the same GPU). Neither hangs nor disturbs the
other: the stream decoding meanwhile keeps its greedy tokens, and the pushed prompt decodes
as one written in process does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.pushes_during_steps import LONG, pushes_during_steps
from tests.tiny import save_hf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pairs-gpu-model")
    save_hf("v2-group-yarn", path, std=0.08)
    return path


def test_nccl_pairs_during_nccl_decode_steps(model_dir: Path) -> None:
    run = pushes_during_steps(model_dir, "cuda", "bfloat16", shard_device="cuda:1")
    assert run.steps >= LONG.max_tokens - 1
    assert len(run.pushes) >= 4 and all(n > 0 for n in run.pushes)
    assert run.meanwhile.token_ids == run.alone.token_ids
    assert run.pushed == run.written
