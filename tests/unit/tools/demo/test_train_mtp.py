"""`train-demo --mtp` on a tiny demo: DeepSeek-V3's layout beside the untouched main weights,
HF still equal, and the acceptance count equal to greedy speculation run step by step."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from common.loading.loader import load_model
from common.loading.mtp_weights import load_mtp_layers
from common.model.mtp import mtp_prefill
from tests.unit.tools.demo.test_train import TINY, _make_corpus
from tools.demo.mtp_acceptance import greedy_continuation, sequence_acceptance
from tools.demo.train import TrainConfig, train
from tools.demo.train_mtp import INDEX_FILE, MAIN_FILE, MTP_FILE, MtpTrainConfig, train_mtp


def test_train_demo_mtp_exports_v3_layout(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    root.mkdir()
    _make_corpus(root)
    out = tmp_path / "model"
    base = TrainConfig(
        out=out,
        work_dir=tmp_path / "work",
        corpus_root=root,
        max_steps=2,
        seq_len=64,
        batch_size=2,
        eval_every=10,
        card_eval_chars=3000,
        arch=TINY,
    )
    train(base)
    main_bytes = (out / MAIN_FILE).read_bytes()
    report = train_mtp(
        MtpTrainConfig(
            model_dir=out,
            corpus_root=root,
            max_steps=3,
            seq_len=32,
            batch_size=2,
            eval_chars=3000,
            eval_windows=2,
        )
    )
    assert report["steps"] == 3 and report["acceptance"]["drafted"] > 0
    assert (out / MAIN_FILE).read_bytes() == main_bytes  # the main weights are untouched
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["model_type"] == "deepseek_v2"
    index = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    layer = config["num_hidden_layers"]
    assert index[f"model.layers.{layer}.eh_proj.weight"] == MTP_FILE
    assert index["lm_head.weight"] == MAIN_FILE

    model = load_model(out)
    (mtp,) = load_mtp_layers(out, main=model)
    # Trained with the main model's embedding and head frozen: one copy in memory.
    assert mtp.embed_tokens.weight is model.model.embed_tokens.weight
    assert mtp.shared_head.head.weight is model.lm_head.weight

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.arange(5, 60)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = model.prefill(ids, [len(ids)], all_logits=True).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)

    # The acceptance count, position by position as greedy speculation would check it.
    seq = greedy_continuation(model, ids[:8], 12)
    accepted, drafted = sequence_acceptance(model, mtp, seq, 8)
    want = 0
    for t in range(7, len(seq) - 1):
        target = model.prefill(seq[: t + 2], [t + 2]).logits[0].argmax()
        hidden = model.prefill(seq[: t + 1], [t + 1], all_logits=True).hidden
        with torch.inference_mode():
            draft = mtp_prefill(mtp, model.rope, seq[1 : t + 2], hidden, [t + 1]).logits[0]
        want += int(draft.argmax() == target)
    assert (accepted, drafted) == (want, len(seq) - 8)
