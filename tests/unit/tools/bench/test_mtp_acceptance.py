"""`tpla bench mtp-acceptance` on the demo (a short run), and its refusal of a model without
an MTP layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tiny import save_tiny_chat_model
from tools.cli.main import main

DEMO = Path(__file__).resolve().parents[4] / "models" / "demo"


def test_demo_acceptance_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "mtp-acceptance", "--model", str(DEMO), "--windows", "2", "--new", "8"]
    assert main([*args, "--eval-chars", "20000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["drafted"] == 2 * 8 and 0 <= out["accepted"] <= out["drafted"]
    assert 0.0 <= out["agreement_on_text"] <= 1.0


def test_a_model_without_mtp_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_tiny_chat_model(tmp_path)
    assert main(["bench", "mtp-acceptance", "--model", str(tmp_path), "--windows", "1"]) != 0
    assert "has no MTP layer" in capsys.readouterr().err
