"""`tpla generate` as a real process: JSON contract, equality with the in-process engine."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from common.loading.loader import load_model
from common.model.generate import generate
from common.sampling.params import SamplingParams
from common.text.tokenizer import Tokenizer
from tests.cli import run_tpla
from tests.tiny import save_tiny_chat_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("cli-model"))


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_tpla("generate", *args)


def test_generate_json_matches_in_process(model_dir: Path) -> None:
    proc = _run(
        "--model",
        str(model_dir),
        "--prompt-ids",
        "5,9,33,70",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = generate(
        load_model(model_dir),
        [5, 9, 33, 70],
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    )
    assert result["token_ids"] == expected.token_ids
    assert result["text"] == Tokenizer.from_dir(model_dir).decode(expected.token_ids)


def test_generate_text_prompt_seeded_sampling_is_reproducible(model_dir: Path) -> None:
    args = (
        "--model",
        str(model_dir),
        "--prompt",
        "hello wörld",
        "--max-tokens",
        "6",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--seed",
        "7",
        "--ignore-eos",
        "--json",
    )
    first, second = _run(*args), _run(*args)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout.splitlines()[-1]) == json.loads(second.stdout.splitlines()[-1])
    assert len(json.loads(first.stdout.splitlines()[-1])["token_ids"]) == 6


def test_generate_bad_input_is_a_clear_error(model_dir: Path, tmp_path: Path) -> None:
    too_long = _run("--model", str(model_dir), "--prompt-ids", "1,2", "--max-tokens", "5000")
    assert too_long.returncode == 2 and "exceeds the model's context" in too_long.stderr
    no_model = _run("--model", str(tmp_path), "--prompt-ids", "1")
    assert no_model.returncode == 2 and "no config.json" in no_model.stderr
    bad_ids = _run("--model", str(model_dir), "--prompt-ids", "1,x")
    assert bad_ids.returncode != 0 and "comma-separated" in bad_ids.stderr
    out_of_vocab = _run("--model", str(model_dir), "--prompt-ids", "99999")
    assert out_of_vocab.returncode == 2 and "token ids must be in" in out_of_vocab.stderr
