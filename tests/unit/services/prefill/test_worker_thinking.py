"""The prefill worker's first token of a reasoning request follows the decode leader's rule
(common/sampling/thinking.py): free while the request thinks (its grammar waits), the
think-end token once the budget is spent (at once for a budget of 0), the grammar's after a
migrated request's earlier think-end token, for every choice."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.kv.transfer import make_sender
from common.loading.serving_model import load_prefill_model
from common.messages import Reservation
from common.sampling.grammar import GrammarCompiler, GrammarKind, GrammarSpec
from common.sampling.params import SamplingParams
from common.text.tokenizer import Tokenizer
from services.prefill.batch.job import PrefillJob
from services.prefill.runner import LocalRunner
from services.prefill.worker import PrefillWorker
from tests.tiny import save_tiny_chat_model

NO_TARGETS = Reservation("", 16, 0, 0, "float32", 30.0, ())
END = 300  # the think-end token
GRAMMAR = GrammarSpec(GrammarKind.REGEX, "[a-c]+")
PROMPT = [5, 9, 14, 30, 31, 7]


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    path: Path = save_tiny_chat_model(tmp_path_factory.mktemp("thinking-prefill"), std=0.08)
    tok = Tokenizer.from_dir(path)
    grammars = GrammarCompiler.from_model_dir(path, 320, sorted(tok.eos_token_ids))
    runner = LocalRunner(load_prefill_model(path, None), make_sender("grpc", "thinking"))
    w = PrefillWorker(runner, grammars=grammars)
    yield w, tok
    w.close()


def _firsts(w: PrefillWorker, params: SamplingParams, outputs: list[int] = (), n: int = 2):  # type: ignore[assignment, no-untyped-def]
    job = PrefillJob(
        "r", [*PROMPT, *outputs], params, NO_TARGETS, 30.0, num_output_tokens=len(outputs), n=n
    )
    return [t.token_id for t in w.submit(job).result(timeout=60).first_tokens]


def test_first_token_free_forced_or_under_the_grammar(worker) -> None:  # type: ignore[no-untyped-def]
    w, tok = worker
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    free = _firsts(w, greedy)
    assert not set(tok.decode(free[:1])) <= set("abc")  # the grammar would not allow it
    thinking = SamplingParams(max_tokens=8, temperature=0.0, grammar=GRAMMAR, think_end_ids=(END,))
    assert _firsts(w, thinking) == free  # the grammar waits for the end of the thinking
    spent = SamplingParams(max_tokens=8, temperature=0.0, think_end_ids=(END,), thinking_budget=0)
    assert _firsts(w, spent) == [END, END]
    (x,) = tok.encode("x")
    two = SamplingParams(
        max_tokens=8, temperature=0.0, grammar=GRAMMAR, think_end_ids=(END,), thinking_budget=2
    )
    assert _firsts(w, two, [x, x]) == [END, END]  # migrated with its budget spent
    after = _firsts(w, two, [x, END])  # its answer starts: nothing but the grammar's
    assert all(tok.decode([t]) and set(tok.decode([t])) <= set("abc") for t in after), after
