"""Logits processing and the decode leader's per-sequence controls on CUDA equal the CPU
results (run by `pytest -m gpu` where CUDA exists)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.sampling.grammar import GrammarKind, GrammarSpec
from common.sampling.logits import context_for, process_logits
from services.decode.leader.controls import StepControls
from tests.tiny import save_tiny_chat_model
from tests.unit.common.sampling.test_logits import EOS, PARAMS, V, _case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_process_logits_on_cuda_equals_cpu() -> None:
    logits, prompts, outputs, allowed = _case(3)
    cpu = process_logits(
        logits, PARAMS, context_for(PARAMS, prompts, outputs, EOS, V, "cpu", allowed)
    )
    ctx = context_for(PARAMS, prompts, outputs, EOS, V, "cuda", allowed.cuda())
    gpu = process_logits(logits.cuda(), PARAMS, ctx)
    torch.testing.assert_close(gpu.cpu(), cpu)


def test_step_controls_on_cuda(tmp_path: Path) -> None:
    model = save_tiny_chat_model(tmp_path, std=0.08)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    controls = StepControls(str(model), vocab, {1}, 4, torch.device("cuda"))
    p = replace(PARAMS[1], grammar=GrammarSpec(GrammarKind.CHOICE, json.dumps(["ab", "cd"])))
    matcher = controls.matcher(p, [])
    seq = controls.start(p, matcher, [5, 6], [])
    ctx = controls.context([seq], [0])
    assert ctx.allowed is not None and ctx.allowed.is_cuda and ctx.allowed.any()
    assert ctx.output_counts is not None and ctx.output_counts.is_cuda
    token = int(torch.nonzero(ctx.allowed[0])[0])
    controls.advance([seq], [token])
    assert int(controls.history.counts[seq.history_row, token]) == 1
    controls.release(seq)
