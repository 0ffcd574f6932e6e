"""Shard-wise loading onto a GPU: a rank read straight onto cuda (FP8 dequantized there or
kept FP8, the side file's rotation computed on the CPU) holds the same bits as the same rank
read on the CPU and moved (run by `pytest -m gpu` where CUDA exists)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.loading.serving_model import open_serving_weights
from common.parallel import ParallelConfig
from services.decode.rank.rank_model import RankModel
from tests.shard_checkpoints import (
    FP8_CONFIG,
    quantize,
    random_state,
    save_checkpoint,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("weight_dtype", ["dequantize", "float8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_rank_read_onto_cuda_equals_one_read_on_the_cpu(
    tmp_path: Path, dtype: str, weight_dtype: str
) -> None:
    fp8, _ = quantize(random_state())
    model_dir = save_checkpoint(fp8, tmp_path / "fp8", quantization_config=FP8_CONFIG)
    parallel = ParallelConfig(tp=2, latent_groups=2)
    for rank in range(2):
        # `auto` would keep FP8 on cuda and dequantize on the CPU: name the same one for both.
        cuda, cpu = (
            RankModel(
                open_serving_weights(model_dir, None, dtype, device, weight_dtype)[0],
                parallel,
                rank,
            )
            for device in ("cuda", "cpu")
        )
        # The state dict: an FP8 weight's values and scales are buffers, not parameters.
        got, want = cuda.state_dict(), cpu.state_dict()
        assert sorted(got) == sorted(want)
        for name, p in got.items():
            assert p.is_cuda and torch.equal(p.cpu(), want[name]), name
