"""Tiny real checkpoints (built with HF transformers) shared by the TPLA tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.model.loader import load_model
from common.model.model import DeepseekForCausalLM
from common.tpla.calibration import LatentStatistics, collect_latent_statistics
from tests.model.tiny import save_hf
from tests.unit.test_tokenizer import CORPUS, TEMPLATE, _train

VOCAB = 320


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V2 checkpoint with a tokenizer (d_c = 32, 4 heads, 3 layers)."""
    path = tmp_path_factory.mktemp("tpla-tiny")
    save_hf("v2-greedy", path, std=0.05, vocab_size=VOCAB)
    _train(VOCAB, CORPUS).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": TEMPLATE})
    )
    return path


@pytest.fixture()
def tiny_model(tiny_dir: Path) -> DeepseekForCausalLM:
    return load_model(tiny_dir)


def random_windows(
    count: int, length: int, vocab: int = VOCAB, seed: int = 0
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen) for _ in range(count)]


def calibrate(model: DeepseekForCausalLM, seed: int = 0) -> LatentStatistics:
    return collect_latent_statistics(
        model, random_windows(3, 64, model.config.vocab_size, seed), progress=False
    )
