"""Loading DeepSeek-V3's MTP layers: whole and a rank's slices, FP8 kept or dequantized, the
main model unchanged by them, and the embedding / head shared with the main model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import Tensor

from common.loading.checkpoint import CheckpointError
from common.loading.loader import load_model
from common.loading.mtp_weights import RankMTPParts, build_mtp_layer, load_mtp_layers
from common.loading.rank_slices import head_layer, rank_ffn
from common.loading.weights import CheckpointWeights
from common.model.fp8 import Fp8Weight, dense
from common.model.mtp import mtp_prefill
from common.parallel import ParallelConfig
from tests.shard_checkpoints import (
    CONFIG,
    MTP_CONFIG,
    mtp_state,
    quantize,
    random_state,
    save_checkpoint,
)

L = CONFIG["num_hidden_layers"]  # the MTP layer's index


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    main = random_state()
    root = tmp_path_factory.mktemp("mtp")
    out = {"plain": save_checkpoint(main, root / "plain")}
    for shared in ("equal", "absent", "different"):
        state = {**main, **mtp_state(main, shared)}
        out[shared] = save_checkpoint(state, root / shared, **MTP_CONFIG)
    fp8, dequantized = quantize({**main, **mtp_state(main, "equal")})
    quant = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    out["fp8"] = save_checkpoint(fp8, root / "fp8", **MTP_CONFIG, **quant)
    out["dequantized"] = save_checkpoint(dequantized, root / "dequantized", **MTP_CONFIG)
    return out


def test_the_main_model_ignores_the_mtp_layer(dirs: dict[str, Path]) -> None:
    ids = torch.arange(2, 40)
    plain = load_model(dirs["plain"]).prefill(ids, [len(ids)], all_logits=True).logits
    with_mtp = load_model(dirs["equal"])
    assert with_mtp.config.num_nextn_predict_layers == 1
    assert len(with_mtp.model.layers) == L
    assert torch.equal(with_mtp.prefill(ids, [len(ids)], all_logits=True).logits, plain)
    assert load_mtp_layers(dirs["plain"]) == []


def test_whole_layer_reads_every_tensor(dirs: dict[str, Path]) -> None:
    from safetensors.torch import load_file

    stored: dict[str, Tensor] = {}
    for f in dirs["different"].glob("*.safetensors"):
        stored.update(load_file(str(f)))
    (layer,) = load_mtp_layers(dirs["different"])
    prefix = f"model.layers.{L}."
    for name, value in layer.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            e = 1
            want = torch.cat(
                [stored[f"{prefix}mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up")]
            )
            assert torch.equal(value[e], want)
        elif not name.endswith("experts.down_proj"):
            assert torch.equal(value, stored[prefix + name]), name


@pytest.mark.parametrize("shared", ["equal", "absent", "different"])
def test_embedding_and_head_are_the_main_models_when_equal(
    dirs: dict[str, Path], shared: str
) -> None:
    main = load_model(dirs[shared])
    (layer,) = load_mtp_layers(dirs[shared], main=main)
    same = layer.embed_tokens.weight is main.model.embed_tokens.weight
    assert same == (shared != "different")
    assert (layer.shared_head.head.weight is main.lm_head.weight) == (shared != "different")
    (alone,) = load_mtp_layers(dirs[shared])  # without the main model: its own tensors
    assert torch.equal(alone.embed_tokens.weight, layer.embed_tokens.weight)


def test_fp8_kept_equals_dequantized(dirs: dict[str, Path]) -> None:
    main = load_model(dirs["dequantized"])
    (kept,) = load_mtp_layers(dirs["fp8"], keep_fp8=True)
    (read,) = load_mtp_layers(dirs["fp8"])
    (ref,) = load_mtp_layers(dirs["dequantized"])
    assert isinstance(kept.eh_proj, Fp8Weight) and isinstance(kept.self_attn.kv_b_proj, Fp8Weight)
    assert not isinstance(read.eh_proj, Fp8Weight)
    assert torch.equal(dense(kept.eh_proj), ref.eh_proj.weight)
    assert torch.equal(read.eh_proj.weight, ref.eh_proj.weight)
    ids = torch.arange(2, 30)
    hidden = main.prefill(ids[:-1], [len(ids) - 1], all_logits=True).hidden
    assert hidden is not None
    outs = [
        mtp_prefill(layer, main.rope, ids[1:], hidden, [len(hidden)], all_logits=True).logits
        for layer in (kept, read, ref)
    ]
    torch.testing.assert_close(outs[0], outs[2], rtol=0, atol=1e-5)
    torch.testing.assert_close(outs[1], outs[2], rtol=0, atol=1e-6)


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_slices_equal_slices_of_the_whole_layer(dirs: dict[str, Path], tp: int) -> None:
    src = CheckpointWeights(dirs["different"], torch.float32, mtp=True)
    whole = build_mtp_layer(src, 0)
    parallel = ParallelConfig(tp=tp)
    c = src.config
    for rank in range(tp):
        parts = RankMTPParts(src, 0, parallel, rank)
        rows = parallel.vocab_rows(rank, c.vocab_size)
        assert torch.equal(parts.lm_head, whole.shared_head.head.weight[rows])
        assert torch.equal(parts.eh_proj.weight, whole.eh_proj.weight)
        for mine, theirs in ((parts.enorm, whole.enorm), (parts.norm, whole.shared_head.norm)):
            assert torch.equal(mine.weight, theirs.weight)
        assert torch.equal(parts.embed.weight, whole.embed_tokens.weight)
        layer = head_layer(src, L, parallel, rank)
        heads = parallel.heads(rank, c.num_attention_heads)
        per = c.qk_head_dim
        q_rows = slice(heads.start * per, heads.stop * per)
        assert torch.equal(layer.self_attn.q_b_proj.weight, whole.self_attn.q_b_proj.weight[q_rows])
        ffn = rank_ffn(src, L, parallel, rank)
        cols = parallel.expert_columns(rank, c.moe_intermediate_size)
        width = cols.stop - cols.start
        inter = c.moe_intermediate_size
        gate_up = whole.mlp.experts.gate_up_proj
        assert torch.equal(ffn.experts.gate_up_proj[:, :width], gate_up[:, cols])
        assert torch.equal(
            ffn.experts.gate_up_proj[:, width:], gate_up[:, inter + cols.start : inter + cols.stop]
        )


def test_rank_parts_keep_fp8_and_need_the_mtp_source(dirs: dict[str, Path]) -> None:
    src = CheckpointWeights(dirs["fp8"], torch.float32, keep_fp8=True, mtp=True)
    parts = RankMTPParts(src, 0, ParallelConfig(tp=2), 1)
    assert isinstance(parts.eh_proj, Fp8Weight)
    without = CheckpointWeights(dirs["fp8"], torch.float32)
    with pytest.raises(CheckpointError, match="MTP module 0"):
        RankMTPParts(without, 0, ParallelConfig(tp=2), 0)


def test_a_missing_mtp_tensor_is_named(dirs: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    state: dict[str, Tensor] = {}
    for f in dirs["equal"].glob("*.safetensors"):
        state.update(load_file(str(f)))
    del state[f"model.layers.{L}.eh_proj.weight"]
    path = save_checkpoint(state, tmp_path / "broken", files=1, **MTP_CONFIG)
    load_model(path)  # the main model does not need it
    with pytest.raises(CheckpointError, match=rf"missing: model\.layers\.{L}\.eh_proj"):
        load_mtp_layers(path)


def test_rotations_may_leave_the_mtp_layer_in_its_basis(dirs: dict[str, Path]) -> None:
    src = CheckpointWeights(dirs["equal"], torch.float32, mtp=True)
    plain = build_mtp_layer(src, 0).self_attn.kv_b_proj.weight
    eye = torch.eye(src.config.kv_lora_rank, dtype=torch.float64)
    src.use_basis([eye] * L)
    assert torch.equal(build_mtp_layer(src, 0).self_attn.kv_b_proj.weight, plain)
    config = dataclasses.replace(src.config)
    assert config.num_nextn_predict_layers == 1
