"""The planner's MTP counts: a rank's share of the MTP layer equals what the loader holds
(whole, sliced, FP8), its cache is one more layer per module, and `tpla plan --speculative
mtp` adds them (or refuses a model without one)."""

from __future__ import annotations

import itertools
import json
import shlex
from pathlib import Path

import pytest
import torch
from torch import nn

from common.loading.loader import load_model
from common.loading.mtp_weights import RankMTPParts, load_mtp_layers
from common.loading.rank_slices import rank_ffn
from common.loading.weights import CheckpointWeights
from common.model.fp8 import Fp8Weight
from common.model.tpla import latent_shard
from common.parallel import MoeParallel, ParallelConfig, ParallelMode, RmsNormMode
from common.tpla.capacity_plan import GIB, Hardware, PlanError, PlanRequest, build_plan
from common.tpla.rank_memory import kv_bytes_per_stored_token, mtp_tensors, weight_bytes
from services.decode.rank.layers import RankAttention, RankLayer
from tests.shard_checkpoints import (
    CONFIG,
    MTP_CONFIG,
    mtp_state,
    quantize,
    random_state,
    save_checkpoint,
)
from tools.cli.main import main

L = CONFIG["num_hidden_layers"]
LAYOUTS = [(2, 1, "tpla"), (2, 2, "tpla"), (4, 4, "tpla"), (2, 1, "sp")]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plan-mtp")
    main_state = random_state()
    state = {**main_state, **mtp_state(main_state, "equal")}
    fp8, _ = quantize(state, block=4)
    quant = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [4, 4]}}
    return {
        "plain": save_checkpoint(state, root / "plain", files=2, **MTP_CONFIG),
        "fp8": save_checkpoint(fp8, root / "fp8", files=2, **MTP_CONFIG, **quant),
    }


def _bytes(module: nn.Module, leave_out: tuple[nn.Parameter, ...] = ()) -> int:
    held = [p for p in module.parameters() if all(p is not q for q in leave_out)]
    return sum(t.numel() * t.element_size() for t in [*held, *module.buffers()])


def _rank_mtp_bytes(src: CheckpointWeights, parallel: ParallelConfig, rank: int) -> int:
    """A decode rank's MTP share as the engine builds it: the layer as any `RankLayer`, the
    parts around it, less the embedding and head (the main model's)."""
    c = src.config
    shard = latent_shard(parallel.latent_columns(rank, c.kv_lora_rank), parallel.latent_groups)
    heads = parallel.heads(rank, c.num_attention_heads)
    layer = RankLayer(
        src,
        L,
        RankAttention(src, L, heads, shard, parallel.rmsnorm),
        rank_ffn(src, L, parallel, rank),
    )
    rows = parallel.vocab_rows(rank, c.vocab_size)
    main = (
        nn.Parameter(src.tensor("model.embed_tokens.weight")),
        nn.Parameter(src.tensor("lm_head.weight", rows)),
    )
    parts = RankMTPParts(src, 0, parallel, rank, main)
    assert parts.embed.weight is main[0] and parts.lm_head is main[1]
    return _bytes(layer) + _bytes(parts, main)


def test_the_whole_mtp_layer_is_planned_as_loaded(dirs: dict[str, Path]) -> None:
    model = load_model(dirs["plain"])
    (layer,) = load_mtp_layers(dirs["plain"], main=model)
    shared = (layer.embed_tokens.weight, layer.shared_head.head.weight)
    assert shared == (model.model.embed_tokens.weight, model.lm_head.weight)
    planned = weight_bytes(mtp_tensors(model.config, ParallelConfig(), 0, 1), "float32")
    assert planned == _bytes(layer, shared)


def test_rank_shares_are_planned_as_loaded(dirs: dict[str, Path]) -> None:
    src = CheckpointWeights(dirs["plain"], torch.float32, mtp=True)
    for (tp, r, mode), rmsnorm, moe in itertools.product(LAYOUTS, RmsNormMode, MoeParallel):
        parallel = ParallelConfig(tp, r, rmsnorm, ParallelMode(mode), moe=moe)
        for rank in range(tp):
            planned = weight_bytes(mtp_tensors(src.config, parallel, rank, 1), "float32")
            assert planned == _rank_mtp_bytes(src, parallel, rank), (tp, r, mode, rank)


def test_fp8_rank_shares_are_planned_as_held(dirs: dict[str, Path]) -> None:
    src = CheckpointWeights(dirs["fp8"], torch.bfloat16, keep_fp8=True, mtp=True)
    for tp, r, mode in LAYOUTS:
        parallel = ParallelConfig(tp, r, mode=ParallelMode(mode))
        for rank in range(tp):
            assert isinstance(RankMTPParts(src, 0, parallel, rank).eh_proj, Fp8Weight)
            planned = weight_bytes(mtp_tensors(src.config, parallel, rank, 1), "float8", (4, 4))
            assert planned == _rank_mtp_bytes(src, parallel, rank), (tp, r, mode, rank)


def test_the_plan_adds_the_mtp_weights_and_cache(dirs: dict[str, Path]) -> None:
    c = CheckpointWeights(dirs["plain"], torch.float32).config
    parallel = ParallelConfig(2, 2)
    base = kv_bytes_per_stored_token(c, parallel, "bfloat16")
    assert kv_bytes_per_stored_token(c, parallel, "bfloat16", 1) == base * (L + 1) // L
    hw = Hardware(gpu_mem_bytes=4 * GIB, gpus_per_group=2, reserve_bytes=GIB)
    without = build_plan(c, PlanRequest(hw, context=256))
    with_mtp = build_plan(c, PlanRequest(hw, context=256, mtp_layers=1))
    extra = weight_bytes(mtp_tensors(c, parallel, 0, 1), "bfloat16")
    assert with_mtp.chosen.weights_bytes == without.chosen.weights_bytes + extra
    assert with_mtp.chosen.max_tokens < without.chosen.max_tokens
    assert dict(with_mtp.breakdown)["mtp"] == extra
    with pytest.raises(PlanError, match="2 MTP layers asked for; the model has 1"):
        build_plan(c, PlanRequest(hw, context=256, mtp_layers=2))


def test_cli_counts_mtp_only_when_asked(
    dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = f"plan --model {dirs['plain']} --gpu-mem-gib 4 --gpus-per-group 2 --context 256 --json"
    outs = {}
    for spec in ("none", "mtp"):
        assert main([*shlex.split(args), "--speculative", spec]) == 0
        outs[spec] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert outs["none"]["mtp_layers_not_loaded"] == 1 and outs["none"]["mtp_layers_loaded"] == 0
    assert outs["mtp"]["mtp_layers_not_loaded"] == 0 and outs["mtp"]["mtp_layers_loaded"] == 1
    assert outs["mtp"]["weights_bytes_per_rank"] > outs["none"]["weights_bytes_per_rank"]
    plain = tmp_path / "config.json"
    raw = json.loads((dirs["plain"] / "config.json").read_text())
    plain.write_text(json.dumps({**raw, "num_nextn_predict_layers": 0}))
    cmd = f"plan --config {plain} --gpu-mem-gib 4 --gpus-per-group 2 --context 256"
    assert main([*shlex.split(cmd), "--speculative", "mtp"]) != 0
    assert "has no MTP layer" in capsys.readouterr().err
