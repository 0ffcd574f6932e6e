"""Which stored tensors the served model reads (common/loading/text_names.py): a wrapper's text
model under its prefix, nothing of its vision tower, A.X-K1's MoE output norm where used."""

from __future__ import annotations

from pathlib import Path

from common.loading.loader import load_model
from common.loading.text_names import served_name
from common.model.args import ModelConfig
from tests.tiny_families import save_family


def test_a_wrapper_serves_its_text_model_only(tmp_path: Path) -> None:
    save_family("kimi-k25", tmp_path)
    model = load_model(tmp_path)
    assert model.config.model_type == "kimi_k25"
    assert not any("vision" in name or "projector" in name for name in model.state_dict())


def test_names_map_to_the_text_model() -> None:
    config = ModelConfig.from_dir(Path(__file__).parents[4] / "models/demo")
    assert served_name("language_model.model.layers.0.mlp.gate.weight", config) == (
        "model.layers.0.mlp.gate.weight"
    )
    assert served_name("language_model.lm_head.weight", config) == "lm_head.weight"
    assert served_name("model.language_model.embed_tokens.weight", config) == (
        "model.embed_tokens.weight"
    )
    assert served_name("model.vision_tower.blocks.0.weight", config) is None
    assert served_name("mm_projector.proj.0.weight", config) is None
    # A MoE output norm the model does not use (no such feature here) is not read.
    assert served_name("model.layers.1.post_mlp_layernorm.weight", config) is None
