"""Weight sources: routers read in float32 from the stored values, experts read by run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.loading.loader import load_model
from common.loading.rank_slices import rank_ffn
from common.loading.weights import ALL, CheckpointWeights, ModelWeights
from common.parallel import MoeParallel, ParallelConfig
from tests.tiny import save_hf

BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
GATE = "model.layers.1.mlp.gate.weight"


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("v3")
    save_hf("v3-noaux-yarn", path)
    return path


def _stored(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_a_bf16_load_keeps_the_router_bit_exact(v3_dir: Path) -> None:
    stored = _stored(v3_dir)
    bias, gate = stored[BIAS], stored[GATE]
    assert bias.dtype == torch.float32 and not torch.equal(bias, bias.bfloat16().float())
    model = load_model(v3_dir, dtype="bfloat16")
    router = model.model.layers[1].mlp.gate
    assert torch.equal(router.e_score_correction_bias, bias)
    assert torch.equal(router.weight, gate)
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    src = CheckpointWeights(v3_dir, torch.bfloat16)
    local = rank_ffn(src, 1, ParallelConfig(tp=2), 1)
    assert torch.equal(local.gate.e_score_correction_bias, bias)
    assert torch.equal(local.gate.weight, gate)


@pytest.mark.parametrize("fused", [False, True])
def test_expert_runs_equal_slices_of_the_stack(v3_dir: Path, tmp_path: Path, fused: bool) -> None:
    path = v3_dir
    if fused:  # the transformers-5 layout: one gate_up_proj / down_proj per layer
        path = tmp_path
        state = {k: v.contiguous() for k, v in load_model(v3_dir).state_dict().items()}
        save_file(state, str(path / "model.safetensors"))
        (path / "config.json").write_text((v3_dir / "config.json").read_text())
    src = CheckpointWeights(path, torch.float32)
    whole = ModelWeights(load_model(v3_dir))
    prefix = "model.layers.1.mlp.experts"
    for experts in (slice(0, 3), slice(3, 8), slice(7, 8)):
        for cols in (ALL, slice(8, 24)):
            want_up = whole.gate_up(prefix, cols, experts)
            assert want_up.shape[0] == experts.stop - experts.start
            assert torch.equal(src.gate_up(prefix, cols, experts), want_up)
            assert torch.equal(src.down(prefix, cols, experts), whole.down(prefix, cols, experts))


def test_an_ep_rank_holds_whole_experts(v3_dir: Path) -> None:
    src = CheckpointWeights(v3_dir, torch.float32)
    full = load_model(v3_dir).model.layers[1].mlp
    par = ParallelConfig(tp=2, moe=MoeParallel.EP)
    for rank, held in ((0, slice(0, 4)), (1, slice(4, 8))):
        local = rank_ffn(src, 1, par, rank)
        assert local.first_expert == held.start
        assert torch.equal(local.experts.gate_up_proj, full.experts.gate_up_proj[held])
        assert torch.equal(local.experts.down_proj, full.experts.down_proj[held])
        shared = full.shared_experts.down_proj.weight.shape[1] // 2
        assert local.shared_experts.down_proj.weight.shape[1] == shared  # split by columns
