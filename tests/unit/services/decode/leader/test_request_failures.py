"""The leader says whose failure ends a choice: a grammar that cannot go on (its parser
stopped at a limit, or rejected a token) is the request's own, and the choice ends without
the token sampled for it; a group that stops ends every live choice as the group's."""

from __future__ import annotations

from pathlib import Path

import torch

from common.messages import FailureScope
from common.sampling.grammar import GrammarKind, GrammarSpec
from common.sampling.grammar_limits import GrammarLimits
from common.sampling.params import SamplingParams
from common.sampling.sampler import SampledToken
from common.text.tokenizer import Tokenizer
from services.decode.leader.controls import StepControls
from services.decode.leader.step import LiveChoice, _event
from services.decode.stream import TokenStream
from tests.tiny import save_tokenizer

V = 320
AMBIGUOUS = GrammarSpec(GrammarKind.GRAMMAR, 'start: s\ns: s s | "a" | "b"\n')


def test_a_grammar_past_its_limit_fails_its_sequence_alone(tmp_path: Path) -> None:
    save_tokenizer(tmp_path, V)
    (a,) = Tokenizer.from_dir(tmp_path).encode("a")
    controls = StepControls(
        str(tmp_path), V, {1}, 4, torch.device("cpu"), GrammarLimits(step_max_items=100)
    )
    constrained = SamplingParams(grammar=AMBIGUOUS)
    seqs = [
        controls.start(constrained, controls.matcher(constrained, []), [3], []),
        controls.start(SamplingParams(), None, [3], []),
    ]
    for step in range(60):
        ctx = controls.context(seqs, [step, step])  # never raises: the failure is recorded
        assert ctx.allowed is not None
        controls.advance(seqs, [a, a])
        if seqs[0].failed:
            break
    assert 5 < step < 60
    assert seqs[0].failure.startswith("structured output: the grammar cannot go on")
    assert not seqs[1].failed
    # Its choice ends with the request's own failure, without the token sampled for it.
    live = LiveChoice(constrained, TokenStream(), 0, seqs[0], choice=2)
    event = _event(live, SampledToken(a, -0.1), "stop")
    assert event.token is None and event.index == 2
    assert event.failure is FailureScope.REQUEST
    assert event.finish_reason == f"error: {seqs[0].failure}"
    # A sequence that did not fail streams its token as before.
    plain = LiveChoice(SamplingParams(), TokenStream(), 0, seqs[1])
    assert _event(plain, SampledToken(a, -0.1), None).token == SampledToken(a, -0.1)


def test_a_rejected_token_fails_the_sequence(tmp_path: Path) -> None:
    save_tokenizer(tmp_path, V)
    tok = Tokenizer.from_dir(tmp_path)
    controls = StepControls(str(tmp_path), V, {1}, 4, torch.device("cpu"))
    spec = GrammarSpec(GrammarKind.CHOICE, '["ab"]')
    params = SamplingParams(grammar=spec)
    seq = controls.start(params, controls.matcher(params, []), [3], [])
    (z,) = tok.encode("z")
    controls.advance([seq], [z])
    assert "z" in seq.failed
    controls.advance([seq], [z])  # a failed grammar is left alone
    assert controls.context([seq], [1]).allowed is not None
