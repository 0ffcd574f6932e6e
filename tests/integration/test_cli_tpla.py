"""`tpla convert`, `tpla eval --json` and `tpla generate --mode` as real processes."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common.loading.loader import load_model
from common.loading.side_file import Method, load_side_file
from common.model.generate import generate
from common.sampling.params import SamplingParams
from common.text.tokenizer import Tokenizer
from common.tpla.eval import EvalConfig, evaluate
from tests.cli import run_tpla
from tests.tiny import CORPUS

WINDOW, PREFILL, MAX_TOKENS = 64, 16, 200


def _tpla(*args: str) -> subprocess.CompletedProcess[str]:
    return run_tpla(*args)


@pytest.fixture(scope="module")
def model_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "model"
    shutil.copytree(tiny_dir, path)
    return path


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text("\n".join(CORPUS))
    return path


def test_convert_writes_a_side_file_then_eval_prints_the_contract(
    model_dir: Path, text_file: Path
) -> None:
    conv = _tpla("convert", "--model", str(model_dir), "--method", "pca", "--calib", str(text_file))
    assert conv.returncode == 0, conv.stderr
    assert json.loads(conv.stdout.splitlines()[-1])["side_file"] == str(model_dir / "tpla_pca.json")
    assert load_side_file(model_dir / "tpla_pca.json").method is Method.PCA

    proc = _tpla(
        "eval",
        "--model", str(model_dir),
        "--groups", "2",
        "--eval-text", str(text_file),
        "--calib", str(text_file),
        "--window", str(WINDOW),
        "--prefill-len", str(PREFILL),
        "--max-tokens-eval", str(MAX_TOKENS),
        "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "side file tpla_pca.json" in proc.stderr  # pca's basis came from convert
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) == {"groups", "results"} and result["groups"] == 2
    rows = {(r["variant"], r["method"], r["rmsnorm"]): r["ppl"] for r in result["results"]}
    expected = {("mla", None, None), ("gla", None, None)} | {
        (v, m, n)
        for v in ("tpla", "tpla-pd")
        for m in ("identity", "hadamard", "pca")
        for n in ("exact", "sliced")
    }
    assert set(rows) == expected and len(result["results"]) == len(expected)
    assert all(set(r) == {"variant", "method", "rmsnorm", "ppl"} for r in result["results"])
    assert all(math.isfinite(p) and p > 1 for p in rows.values())
    assert rows[("gla", None, None)] != rows[("mla", None, None)]

    # MLA's number is the plain model's perplexity on the same scored positions.
    model = load_model(model_dir)
    ids = Tokenizer.from_dir(model_dir).encode(text_file.read_text(), add_bos=False)[:MAX_TOKENS]
    nll, count = 0.0, 0
    for start in range(0, len(ids), WINDOW):
        window = torch.tensor(ids[start : start + WINDOW])
        if len(window) - 1 <= PREFILL:
            continue
        logits = model.prefill(window, [len(window)], all_logits=True).logits
        nll += float(F.cross_entropy(logits[PREFILL:-1], window[PREFILL + 1 :], reduction="sum"))
        count += len(window) - 1 - PREFILL
    assert rows[("mla", None, None)] == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_eval_bad_input_is_a_clear_error(model_dir: Path, text_file: Path) -> None:
    proc = _tpla(
        "eval", "--model", str(model_dir), "--groups", "3", "--eval-text", str(text_file),
    )  # fmt: skip
    assert proc.returncode == 2 and "must divide the latent width 32" in proc.stderr
    config = EvalConfig(groups=2, window=32, prefill_len=31, eval_path=str(text_file))
    with pytest.raises(ValueError, match="leaves nothing to score in windows of 32"):
        evaluate(model_dir, config)
    if not torch.cuda.is_available():  # a GPU asked for where there is none: exit 2, named
        proc = _tpla("eval", "--model", str(model_dir), "--groups", "2", "--device", "cuda")
        assert proc.returncode == 2 and "no visible CUDA device" in proc.stderr


def test_generate_modes(model_dir: Path) -> None:
    base = ("generate", "--model", str(model_dir), "--prompt-ids", "5,9,33,70")
    base += ("--max-tokens", "6", "--ignore-eos", "--json")
    want = generate(
        load_model(model_dir),
        [5, 9, 33, 70],
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    ).token_ids
    # One latent group is MLA whatever the basis (pca's side file exists from the test above).
    exact = _tpla(*base, "--mode", "tpla-pd", "--latent-groups", "1")
    assert exact.returncode == 0, exact.stderr
    assert json.loads(exact.stdout.splitlines()[-1])["token_ids"] == want
    sliced = _tpla(*base, "--mode", "tpla", "--latent-groups", "2", "--method", "hadamard",
                   "--rmsnorm", "sliced")  # fmt: skip
    assert sliced.returncode == 0, sliced.stderr
    assert len(json.loads(sliced.stdout.splitlines()[-1])["token_ids"]) == 6
    assert "falling back to the identity basis with e_i = 1/r" in sliced.stderr
