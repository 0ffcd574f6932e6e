"""The committed demo model: DeepSeek proportions, HF parity, and a card that beats gzip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.loading.loader import load_model
from common.text.tokenizer import Tokenizer

DEMO = Path(__file__).resolve().parents[3] / "models" / "demo"


@pytest.fixture(scope="module")
def demo():
    return load_model(DEMO)


def test_architecture_has_deepseek_proportions(demo) -> None:
    c = demo.config
    assert c.model_type == "deepseek_v2" and c.q_lora_rank is None
    assert c.kv_lora_rank == 4 * c.qk_nope_head_dim
    assert c.num_attention_heads >= 8 and c.num_hidden_layers >= 4 and c.hidden_size >= 256
    assert c.max_position_embeddings >= 2048
    assert not c.is_moe_layer(0) and all(c.is_moe_layer(i) for i in range(1, c.num_hidden_layers))
    assert sum(p.numel() for p in demo.parameters()) <= 30_000_000
    assert sum(f.stat().st_size for f in DEMO.iterdir()) <= 50 * 2**20


def test_hf_transformers_logits_match(demo) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    ids = Tokenizer.from_dir(DEMO).encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = demo.prefill(torch.tensor(ids), [len(ids)], all_logits=True).logits
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_model_card_measures_against_baselines() -> None:
    report = json.loads((DEMO / "training_report.json").read_text())
    m = report["metrics"]
    assert report["eval_source"] == "eval split"
    assert m["bits_per_byte"] < m["gzip_bits_per_byte"] < m["unigram_bits_per_byte"]
    card = (DEMO / "README.md").read_text()
    assert f"{m['bits_per_byte']:.3f}" in card and f"{m['gzip_bits_per_byte']:.3f}" in card


def test_mtp_layer_in_v3_layout_with_a_measured_card(demo) -> None:
    from common.loading.mtp_weights import load_mtp_layers
    from common.loading.side_file import load_side_file
    from common.tpla.convert import model_fingerprint

    assert demo.config.num_nextn_predict_layers == 1
    (layer,) = load_mtp_layers(DEMO, main=demo)
    assert layer.embed_tokens.weight is demo.model.embed_tokens.weight  # one copy in memory
    assert layer.shared_head.head.weight is demo.lm_head.weight
    report = json.loads((DEMO / "mtp_training_report.json").read_text())
    rate = report["acceptance"]["rate"]
    assert f"**{rate:.1%}**" in (DEMO / "README.md").read_text()
    for method in ("identity", "hadamard", "pca"):
        side = load_side_file(DEMO / f"tpla_{method}.json")
        assert side.mtp_layers == 1 and side.fingerprint == model_fingerprint(demo)
