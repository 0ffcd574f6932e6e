"""`tpla bench serve`'s prompts: the edit mix is a window of source twice."""

from __future__ import annotations

from pathlib import Path

from tools.bench.serve import Mix, make_prompts

DEMO = Path(__file__).resolve().parents[4] / "models" / "demo"


def test_edit_prompts_repeat_a_window() -> None:
    prompts = make_prompts(str(DEMO), Mix("edit", 64, 16), 3)
    assert len({tuple(p) for p in prompts}) == 3
    for p in prompts:
        assert len(p) == 64 and p[:32] == p[32:]
    plain = make_prompts(str(DEMO), Mix("short", 64, 16), 2)
    assert all(len(p) == 64 and p[:32] != p[32:] for p in plain)
