"""The demo trainer stays working: ~20 steps on a tiny generated corpus, exported and reloaded."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from common.loading.loader import load_model
from common.text.chat_template import ChatMessage
from common.text.tokenizer import Tokenizer
from common.tpla import corpus
from tools.demo.train import DemoArch, TrainConfig, train

TINY = DemoArch.tiny(vocab_size=400, max_position_embeddings=512)


def _make_corpus(root: Path) -> None:
    for i in range(60):
        (root / f"mod_{i}.py").write_text(
            f'def func_{i}(x):\n    """Return x times {i} plus one, for module {i}."""\n'
            f"    return x * {i} + 1\n\n\nclass Thing{i}:\n    value = {i}\n"
        )


def test_train_demo_smoke(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    root.mkdir()
    _make_corpus(root)
    splits = {corpus.split_of(p.name) for p in root.iterdir()}
    assert corpus.Split.TRAIN in splits and len(splits) >= 2  # the split is by path hash
    cfg = TrainConfig(
        out=tmp_path / "model",
        work_dir=tmp_path / "work",
        corpus_root=root,
        minutes=5,
        max_steps=20,
        seq_len=64,
        batch_size=2,
        eval_every=10,
        card_eval_chars=3000,
        arch=TINY,
    )
    report = train(cfg)
    assert report["steps"] == 20
    first, last = report["history"][0], report["history"][-1]
    assert last["train_loss"] < first["train_loss"] + 0.5  # it trains without diverging
    assert report["history"][0]["step"] == 10

    out = cfg.out
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
        "training_report.json",
    ):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v2" and config["q_lora_rank"] is None
    assert config["kv_lora_rank"] == 4 * config["qk_nope_head_dim"]
    assert "bits per byte" in (out / "README.md").read_text()

    # The export reloads with our loader and with HF transformers, with the same logits.
    from transformers import AutoModelForCausalLM

    ours = load_model(out)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = Tokenizer.from_dir(out)
    ids = tok.encode_chat([ChatMessage("user", "Write a Python function `func_3`")])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = ours.prefill(torch.tensor(ids), [len(ids)], all_logits=True).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)

    # Resuming from the work dir continues the step count instead of starting over.
    resumed = train(TrainConfig(**{**cfg.__dict__, "max_steps": 25}))
    assert resumed["steps"] == 25
