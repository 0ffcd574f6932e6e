"""A reasoning request's thinking as every sampler sees it (common/sampling/thinking.py): the
state after a history, the answer a grammar reads, and the allowed tokens: anything while
thinking, only a think-end token once the budget is spent, the grammar's after the end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.sampling.grammar import (
    GrammarCompiler,
    GrammarKind,
    GrammarSpec,
    allowed_tokens,
    new_bitmask,
)
from common.sampling.params import SamplingError, SamplingParams
from common.sampling.thinking import Thinking, allowed_first, answer, constrains, fill
from common.text.tokenizer import Tokenizer
from tests.tiny import CORPUS, train_tokenizer

END = 31  # bit 31 of word 0: the int32 sign bit
V = 300


def test_state_after_a_history_and_token_by_token() -> None:
    params = SamplingParams(think_end_ids=(END, 63), thinking_budget=3)
    assert Thinking.start(SamplingParams()) is None
    t = Thinking.start(params, [5, 6])
    assert t is not None and (t.spent, t.ended, t.forced) == (2, False, False)
    assert [t.take(7), t.forced] == [False, True]
    assert [t.take(63), t.ended, t.spent, t.forced] == [False, True, 3, False]
    assert t.take(5) and t.take(END)  # after the end, every token is the answer's
    copy = t.copy()
    copy.spent = 0
    assert t.spent == 3
    assert answer(params, [1, 2, 63, 4, END, 5]) == [4, END, 5]
    assert answer(params, [1, 2]) == () and answer(SamplingParams(), [1, 2]) == [1, 2]


def test_params_checks_and_what_they_switch_on() -> None:
    with pytest.raises(SamplingError):
        SamplingParams(thinking_budget=4)
    with pytest.raises(SamplingError):
        SamplingParams(think_end_ids=(END,), thinking_budget=-1)
    with pytest.raises(SamplingError):
        SamplingParams(think_end_ids=(-1,))
    plain = SamplingParams(think_end_ids=(END,))
    assert not plain.processed and not plain.tracks_thinking
    budget = SamplingParams(think_end_ids=(END,), thinking_budget=0)
    assert budget.processed and budget.tracks_thinking
    grammar = GrammarSpec(GrammarKind.REGEX, "[a-c]+")
    assert SamplingParams(think_end_ids=(END,), grammar=grammar).tracks_thinking
    assert not SamplingParams(grammar=grammar).tracks_thinking


@pytest.fixture(scope="module")
def compiler(tmp_path_factory: pytest.TempPathFactory) -> tuple[GrammarCompiler, Tokenizer]:
    path: Path = tmp_path_factory.mktemp("thinking-tok")
    train_tokenizer(V, CORPUS).save(str(path / "tokenizer.json"))
    tok = Tokenizer.from_dir(path)
    return GrammarCompiler((path / "tokenizer.json").read_text(), V, [1]), tok


def _allowed(thinking: Thinking | None, matcher: object) -> set[int]:
    row = new_bitmask(1, (V + 31) // 32)
    fill(row[0], thinking, matcher)  # type: ignore[arg-type]
    return set(allowed_tokens(row, V)[0].nonzero().flatten().tolist())


def test_allowed_tokens_while_thinking_at_the_budget_and_after(compiler) -> None:
    grammars, tok = compiler
    matcher = grammars.matcher(GrammarSpec(GrammarKind.REGEX, "[a-c]+"))
    free = _allowed(None, matcher)
    assert free and len(free) < V
    params = SamplingParams(think_end_ids=(END, 32), thinking_budget=2, grammar=None)
    t = Thinking.start(params)
    assert t is not None
    assert _allowed(t, matcher) == set(range(V)) and not constrains(t, matcher)
    assert allowed_first(t, matcher, V, torch.device("cpu")) is None
    t.take(tok.encode("x")[0])
    t.take(tok.encode("y")[0])
    assert constrains(t, matcher) and _allowed(t, matcher) == {END, 32}
    first = allowed_first(t, matcher, V, torch.device("cpu"))
    assert first is not None and set(first[0].nonzero().flatten().tolist()) == {END, 32}
    t.take(32)
    assert _allowed(t, matcher) == free  # the answer: the grammar's tokens
    assert _allowed(t, None) == set(range(V)) and not constrains(t, None)
