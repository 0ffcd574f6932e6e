"""Checkpoint layouts the loader accepts, and the errors it gives for ones it cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from common.loading.checkpoint import CheckpointError
from common.loading.loader import load_model
from common.model.args import ConfigError, ModelConfig
from tests.tiny import save_hf


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    path = tmp_path_factory.mktemp("ref")
    save_hf("v3-noaux-yarn", path)
    model = load_model(path)
    ids = torch.arange(2, 30)
    return path, model.prefill(ids, [len(ids)]).logits


def _copy_config(src: Path, dst: Path, **changes: object) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg))


def _logits(path: Path) -> torch.Tensor:
    ids = torch.arange(2, 30)
    return load_model(path).prefill(ids, [len(ids)]).logits


def test_fused_expert_layout_loads_identically(reference, tmp_path: Path) -> None:
    src, expected = reference
    state = {k: v.contiguous() for k, v in load_model(src).state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    _copy_config(src, tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"))
    torch.testing.assert_close(_logits(tmp_path), expected, atol=1e-6, rtol=0)


def test_sharded_index_and_bf16(reference, tmp_path: Path) -> None:
    src, expected = reference
    state = {k: v.contiguous() for k, v in load_model(src).state_dict().items()}
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / file))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    _copy_config(src, tmp_path)
    torch.testing.assert_close(_logits(tmp_path), expected, atol=1e-6, rtol=0)
    bf16 = load_model(tmp_path, dtype="bfloat16")
    assert bf16.lm_head.weight.dtype == torch.bfloat16


def test_tied_embeddings(reference, tmp_path: Path) -> None:
    src, _ = reference
    state = {k: v.contiguous() for k, v in load_model(src).state_dict().items()}
    state.pop("lm_head.weight")
    _copy_config(src, tmp_path, tie_word_embeddings=True)
    save_file(state, str(tmp_path / "model.safetensors"))
    model = load_model(tmp_path)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_errors_are_clear(reference, tmp_path: Path) -> None:
    src, _ = reference
    state = {k: v.contiguous() for k, v in load_model(src).state_dict().items()}

    fp8 = tmp_path / "fp8"
    _copy_config(src, fp8)
    save_file(
        {**state, "model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(1)},
        str(fp8 / "model.safetensors"),
    )
    # A scale without an FP8 weight (and no quantization_config) is an unexpected tensor.
    with pytest.raises(CheckpointError, match=r"unexpected: .*o_proj\.weight_scale_inv"):
        load_model(fp8)

    missing = tmp_path / "missing"
    _copy_config(src, missing)
    save_file(
        {k: v for k, v in state.items() if "o_proj" not in k}, str(missing / "model.safetensors")
    )
    with pytest.raises(CheckpointError, match=r"missing: model\.layers\.0\.self_attn\.o_proj"):
        load_model(missing)

    extra = tmp_path / "extra"
    _copy_config(src, extra)
    save_file({**state, "model.bogus.weight": torch.ones(2)}, str(extra / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected: model\.bogus\.weight"):
        load_model(extra)

    with pytest.raises(ConfigError, match=r"no config\.json"):
        load_model(tmp_path / "nowhere")


def _hf_v3_dict(**changes: object) -> dict:
    base = {
        "model_type": "deepseek_v3",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "kv_lora_rank": 8,
        "qk_nope_head_dim": 4,
        "qk_rope_head_dim": 4,
        "v_head_dim": 4,
        "max_position_embeddings": 4096,
    }
    return {**base, **changes}


def test_config_rope_layouts_agree() -> None:
    yarn = {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    hub = ModelConfig.from_hf_dict(_hf_v3_dict(rope_theta=10000, rope_scaling=yarn))
    tf5 = ModelConfig.from_hf_dict(
        _hf_v3_dict(
            rope_parameters={
                **{k: v for k, v in yarn.items() if k != "type"},
                "rope_type": "yarn",
                "rope_theta": 10000,
            }
        )
    )
    assert hub == tf5
    assert hub.rope_scaling is not None and hub.rope_scaling.factor == 40
    # DeepSeek-V3's softmax scale: (d_n + d_r)^-1/2 * (0.1 * ln 40 + 1)^2
    m = 0.1 * torch.log(torch.tensor(40.0)).item() + 1
    assert hub.softmax_scale == pytest.approx(8**-0.5 * m * m)
    assert hub.topk_method == "noaux_tc" and hub.scoring_func == "sigmoid"


def test_config_rejects_unsupported() -> None:
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_hf_dict(_hf_v3_dict(model_type="llama"))
    with pytest.raises(ConfigError, match="rope type"):
        ModelConfig.from_hf_dict(_hf_v3_dict(rope_scaling={"type": "dynamic", "factor": 2}))
    with pytest.raises(ConfigError, match="topk_group"):
        ModelConfig.from_hf_dict(
            _hf_v3_dict(
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=4,
                n_group=2,
                topk_group=3,
            )
        )
