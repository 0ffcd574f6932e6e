"""A speculative step's logits context: row j of a sequence with drafts equals the plain
context of the same sequence after it generated its first j drafts (counts, min_tokens, the
grammar's allowed tokens), and building it leaves the sequence's state as it was. A grammar
that cannot go on (its parser stopped at a limit, or rejected a token) is the request's own
failure: its choice ends without the token sampled for it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from common.messages import FailureScope
from common.sampling.grammar import GrammarKind, GrammarSpec
from common.sampling.grammar_limits import GrammarLimits
from common.sampling.params import SamplingParams
from common.sampling.sampler import SampledToken
from common.text.tokenizer import Tokenizer
from services.decode.leader.controls import StepControls
from services.decode.leader.live_choice import LiveChoice
from services.decode.stream import TokenStream
from tests.tiny import save_tokenizer

V = 320


def test_draft_rows_are_the_plain_contexts_after_the_drafts(tmp_path: Path) -> None:
    save_tokenizer(tmp_path, V)
    tok = Tokenizer.from_dir(tmp_path)
    controls = StepControls(str(tmp_path), V, {1}, 16, torch.device("cpu"))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = GrammarSpec.json_schema(schema)
    penalized = SamplingParams(frequency_penalty=1.0, min_tokens=4, grammar=grammar)
    plain = SamplingParams(frequency_penalty=0.5, repetition_penalty=1.3)
    text = tok.encode('{"a":12}')
    seqs = [
        controls.start(penalized, controls.matcher(penalized, []), [3, 4], []),
        controls.start(plain, None, [7, 8, 9], [8]),
    ]
    drafts = [[*text[:3], 2], [8, 8]]  # the grammar rejects draft 3 of the first
    ctx = controls.context(seqs, [0, 1], drafts)
    assert ctx.output_counts is not None and ctx.allowed is not None
    assert len(ctx.num_generated) == ctx.output_counts.shape[0] == 8
    # The sequences' own state did not move: their plain context is what it was.
    before = controls.context(seqs, [0, 1])
    rows = [0, 5]
    assert torch.equal(before.output_counts, ctx.output_counts[rows])
    assert torch.equal(before.allowed, ctx.allowed[rows])
    # Row j of each sequence: the plain context after its first j drafts.
    for s, (seq, d, start) in enumerate(zip(seqs, drafts, (0, 5), strict=True)):
        fork = controls.fork(seq)
        for j in range(len(d) + 1):
            plain_ctx = controls.context([fork], [s + j])
            row = start + j
            assert ctx.num_generated[row] == s + j
            assert torch.equal(plain_ctx.output_counts[0], ctx.output_counts[row])
            if seq.matcher is not None and j <= 3:  # through the last draft the grammar takes
                assert torch.equal(plain_ctx.allowed[0], ctx.allowed[row]), (s, j)
            if j < len(d):
                controls.advance([fork], [d[j]])
        controls.release(fork)
    assert ctx.allowed[4].all()  # past the rejected draft: unused, all allowed
    assert json.loads(tok.decode(text)) == {"a": 12}


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
    event = live.event(SampledToken(a, -0.1), "stop")
    assert event.token is None and event.index == 2
    assert event.failure is FailureScope.REQUEST
    assert event.finish_reason == f"error: {seqs[0].failure}"
    # A sequence that did not fail streams its token as before.
    plain = LiveChoice(SamplingParams(), TokenStream(), 0, seqs[1])
    assert plain.event(SampledToken(a, -0.1), None).token == SampledToken(a, -0.1)


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
