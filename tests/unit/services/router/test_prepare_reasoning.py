"""How the served model reasons, decided at start-up (prepare.model_reasoning): off for the
demo (its template never writes </think>), a family by the template and model_type, and a
family named by TPLA_REASONING_PARSER refused for a vocabulary without a </think> token."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.text.tokenizer import Tokenizer
from services.router.prepare import call_markup, model_reasoning
from services.router.reasoning import ReasoningFamily
from services.router.tools import CallMarkup
from tests.tiny import save_reasoning_tokenizer, save_tokenizer

DEMO = Path(__file__).resolve().parents[4] / "models" / "demo"


def test_the_demo_does_not_reason() -> None:
    tok = Tokenizer.from_dir(DEMO)
    assert model_reasoning("auto", DEMO, tok) is None
    assert call_markup(tok) is CallMarkup.DEEPSEEK_V3


def test_families_by_the_model_and_by_name(tmp_path: Path) -> None:
    (tmp_path / "v31").mkdir()
    (tmp_path / "v32").mkdir()
    v31 = save_reasoning_tokenizer(tmp_path / "v31", 330)
    tok = Tokenizer.from_dir(v31)
    got = model_reasoning("auto", v31, tok)
    assert got is not None and got.family is ReasoningFamily.DEEPSEEK_V3
    assert got.end_id == tok.encode("</think>")[0] and not got.special
    assert model_reasoning("none", v31, tok) is None
    forced = model_reasoning("deepseek-r1", v31, tok)
    assert forced is not None and forced.family is ReasoningFamily.DEEPSEEK_R1
    v32 = save_reasoning_tokenizer(tmp_path / "v32", 330, model_type="deepseek_v32")
    tok = Tokenizer.from_dir(v32)
    got = model_reasoning("auto", v32, tok)
    assert got is not None and got.family is ReasoningFamily.DEEPSEEK_V3
    assert call_markup(tok) is CallMarkup.DSML
    plain = save_tokenizer(tmp_path)  # no </think> token in its vocabulary
    with pytest.raises(ValueError, match="not one token"):
        model_reasoning("deepseek_r1", plain, Tokenizer.from_dir(plain))
    with pytest.raises(ValueError, match="TPLA_REASONING_PARSER"):
        model_reasoning("qwen3", plain, Tokenizer.from_dir(plain))
