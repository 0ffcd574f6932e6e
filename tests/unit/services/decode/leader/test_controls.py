"""A speculative step's logits context: row j of a sequence with drafts equals the plain
context of the same sequence after it generated its first j drafts (counts, min_tokens, the
grammar's allowed tokens), and building it leaves the sequence's state as it was."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from common.sampling.grammar import GrammarSpec
from common.sampling.params import SamplingParams
from common.text.tokenizer import Tokenizer
from services.decode.leader.controls import StepControls
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
