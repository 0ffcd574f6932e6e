"""A reasoning request's controls on the decode leader: its rows are free while it thinks,
only the think-end token once its budget is spent, its grammar's after the end (the grammar
reads none of the thinking); a speculative step's row j is the plain context after j drafts;
a migrated request's history resumes both where they were."""

from __future__ import annotations

from pathlib import Path

import torch

from common.sampling.grammar import GrammarKind, GrammarSpec
from common.sampling.params import SamplingParams
from common.text.tokenizer import Tokenizer
from services.decode.leader.controls import SequenceControls, StepControls
from tests.tiny import save_tokenizer

V = 320
END = 300  # the think-end token
GRAMMAR = GrammarSpec(GrammarKind.REGEX, "[a-c]+")


def _allowed(controls: StepControls, seq: SequenceControls) -> set[int]:
    ctx = controls.context([seq], [0])
    if ctx.allowed is None:
        return set(range(V))
    return set(ctx.allowed[0].nonzero().flatten().tolist())


def test_free_while_thinking_forced_at_the_budget_then_the_grammar(tmp_path: Path) -> None:
    save_tokenizer(tmp_path, V)
    tok = Tokenizer.from_dir(tmp_path)
    (a,), (x,) = tok.encode("a"), tok.encode("x")
    controls = StepControls(str(tmp_path), V, {1}, 16, torch.device("cpu"))
    params = SamplingParams(think_end_ids=(END,), thinking_budget=2, grammar=GRAMMAR)
    seq = controls.start(params, controls.matcher(params, []), [3], [])
    grammar_only = controls.start(SamplingParams(grammar=GRAMMAR), None, [3], [])
    grammar_only.matcher = controls.matcher(SamplingParams(grammar=GRAMMAR), [])
    answer = _allowed(controls, grammar_only)
    assert x not in answer and a in answer
    assert _allowed(controls, seq) == set(range(V))
    controls.advance([seq], [x])  # a thinking token the grammar would refuse
    assert not seq.failed and _allowed(controls, seq) == set(range(V))
    controls.advance([seq], [x])
    assert _allowed(controls, seq) == {END}
    # A step with drafts: row j is what plain decoding allows after the first j drafts.
    drafts = [END, a, a]
    ctx = controls.context([seq], [2], [drafts])
    assert ctx.allowed is not None
    fork = controls.fork(seq)
    for j in range(len(drafts) + 1):
        assert _allowed(controls, fork) == set(ctx.allowed[j].nonzero().flatten().tolist()), j
        if j < len(drafts):
            controls.advance([fork], [drafts[j]])
    assert _allowed(controls, seq) == {END}  # the step's drafts left the sequence as it was
    # A draft the budget does not allow: the rows after it are never used (all allowed).
    ctx = controls.context([seq], [2], [[x, a]])
    assert ctx.allowed is not None and ctx.allowed[1:].all()
    controls.advance([seq], [END])
    assert _allowed(controls, seq) == answer
    controls.advance([seq], [a])
    assert not seq.failed
    # Migrated with that history: its thinking is over and its grammar read only the "a".
    history = [x, x, END, a]
    resumed = controls.start(params, controls.matcher(params, history), [3], history)
    assert resumed.thinking is not None and resumed.thinking.ended
    assert _allowed(controls, resumed) == _allowed(controls, seq)


def test_thinking_without_a_grammar_or_budget_is_not_tracked(tmp_path: Path) -> None:
    save_tokenizer(tmp_path, V)
    controls = StepControls(str(tmp_path), V, {1}, 4, torch.device("cpu"))
    plain = controls.start(SamplingParams(think_end_ids=(END,)), None, [3], [5])
    assert plain.thinking is None and controls.context([plain], [1]).allowed is None
    # A budget alone masks: only the think-end token once it is spent (0: at once).
    budget = SamplingParams(think_end_ids=(END,), thinking_budget=0)
    seq = controls.start(budget, None, [3], [])
    assert _allowed(controls, seq) == {END}
    controls.advance([seq], [END])
    assert controls.context([seq], [1]).allowed is None  # its answer is free: no mask at all
