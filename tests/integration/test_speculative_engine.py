"""Speculative decoding in the real decode engine (multi-process rank groups), in the TPLA
(r = 2), MLA-TP and SP layouts on the torch backend and TPLA on the native kernels: with
n-gram drafts verified in the step, every request's tokens are those of the same group
without speculation, greedy and seeded, with penalties and stops, n = 2, and a grammar;
blocks are all free after."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import jsonschema
import pytest
import torch

from common.loading.serving_model import load_prefill_model
from common.runtime.kernel_choice import KernelConfig
from common.sampling.grammar import GrammarSpec
from common.sampling.params import SamplingParams
from common.sampling.sampler import first_tokens
from common.text.tokenizer import Tokenizer
from services.decode.config import SpecConfig
from services.decode.engine import DecodeEngine
from tests.tiny import save_tiny_chat_model
from tests.tiny_engines import TINY_LAYOUTS, tiny_engine
from tools.local_driver import collect, submit, write_prompt

# The C++ kernels run the rows as they are.
LAYOUTS = {**TINY_LAYOUTS, "tpla-native": TINY_LAYOUTS["tpla"]}
NGRAM = SpecConfig("ngram", tokens=4, max_batch=4)
PLAIN = SpecConfig()
# A prompt that repeats itself: its continuation tends to as well, so drafts are kept.
REPEATING = [40, 41, 42, 43, 44, 45] * 4
OTHER = [7, 99, 13, 250, 31, 64, 5, 188]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("spec-model"), std=0.08)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def engine(request: pytest.FixtureRequest, model_dir: Path):
    attention = "native" if request.param.endswith("native") else "torch"
    kernels = KernelConfig(decode_attention=attention)
    with tiny_engine(model_dir, LAYOUTS[request.param], kernels=kernels, max_batch=16) as eng:
        yield eng


def _run(engine: DecodeEngine, spec: SpecConfig, prompts, params) -> list[list[int]]:
    """Every prompt decoded together under `spec`: each one's tokens (first included) and
    its finish reason last."""
    engine.speculate(spec)
    prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
    before = engine.probe.acceptance.drafted, engine.probe.acceptance.accepted
    results = [collect(*s) for s in submit(engine, prefill, prompts, params)]
    load = engine.load()
    assert (load.running, load.reserved, load.blocks_used) == (0, 0, 0)
    # The choices' events carry their steps' drafts and kept drafts.
    events = [e for r in results for e in r.events]
    assert sum(e.drafted for e in events) == engine.probe.acceptance.drafted - before[0]
    assert sum(e.accepted for e in events) == engine.probe.acceptance.accepted - before[1]
    return [[*r.token_ids, r.finish_reason] for r in results]


def test_drafts_change_no_token(engine: DecodeEngine) -> None:
    """Greedy and seeded, with penalties, min_tokens, logit_bias and top-k/top-p, alone and
    sharing a batch: the same tokens with and without speculation. Drafts are kept for the
    repeating prompt and rejected for sampled ones."""
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True),
        SamplingParams(
            max_tokens=17,
            temperature=0.9,
            top_k=40,
            top_p=0.9,
            seed=8,
            frequency_penalty=0.5,
            repetition_penalty=1.2,
            logit_bias=((44, 3.0),),
            min_tokens=10,
        ),
    ]
    prompts = [REPEATING, OTHER, REPEATING, OTHER]
    plain = _run(engine, PLAIN, prompts, params)
    before = engine.probe.acceptance.drafted, engine.probe.acceptance.accepted
    assert _run(engine, NGRAM, prompts, params) == plain
    drafted = engine.probe.acceptance.drafted - before[0]
    accepted = engine.probe.acceptance.accepted - before[1]
    assert drafted > accepted > 0  # some drafts kept, some rejected
    # One at a time (every step speculates: batch 1 is under the limit).
    for p, prompt, expected in zip(params, prompts, plain, strict=True):
        assert _run(engine, NGRAM, [prompt], [p]) == [expected]


def test_stops_cut_a_kept_run_where_plain_decoding_does(engine: DecodeEngine) -> None:
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    [whole] = _run(engine, PLAIN, [REPEATING], [greedy])
    for cut in (6, 11):
        stop = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(whole[cut],))
        [plain] = _run(engine, PLAIN, [REPEATING], [stop])
        assert plain == [*whole[: whole.index(whole[cut]) + 1], "stop"]
        assert _run(engine, NGRAM, [REPEATING], [stop]) == [plain]
    for limit in (2, 5, 9):  # max_tokens inside a run
        short = SamplingParams(max_tokens=limit, temperature=0.0, ignore_eos=True)
        assert _run(engine, NGRAM, [REPEATING], [short]) == [[*whole[:limit], "length"]]


def test_forked_choices_with_a_seed(engine: DecodeEngine) -> None:
    """n = 2 with a seed: each choice is its own keyed draw, the same with drafts."""
    p = SamplingParams(max_tokens=14, temperature=0.8, seed=21, ignore_eos=True)
    prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)

    def choices(spec: SpecConfig) -> list[list[int]]:
        engine.speculate(spec)
        out = prefill.prefill(torch.tensor(REPEATING), [len(REPEATING)])
        rid = uuid.uuid4().hex
        reservation = engine.reserve(rid, len(REPEATING), p.max_tokens, n=2)
        write_prompt(engine, reservation, out, 0, len(REPEATING))
        firsts = first_tokens(out.logits[0], p, 2, position=len(REPEATING))
        tokens = [[t.token_id] for t in firsts]
        for event in engine.generate(rid, [t.token_id for t in firsts], p, REPEATING):
            if event.token is not None:
                tokens[event.index].append(event.token.token_id)
        return tokens

    plain = choices(PLAIN)
    assert choices(NGRAM) == plain and plain[0] != plain[1]


def test_a_grammar_holds_through_drafts(engine: DecodeEngine, model_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    grammar = GrammarSpec.json_schema(schema)
    params = [
        SamplingParams(max_tokens=60, temperature=t, seed=s, grammar=grammar)
        for t, s in ((0.0, None), (0.8, 4))
    ]
    prompt = tok.encode('{"ok": true, "n": 1} {"ok": false, "n": 2}')
    plain = _run(engine, PLAIN, [prompt, prompt], params)
    assert _run(engine, NGRAM, [prompt, prompt], params) == plain
    for *tokens, reason in plain:
        assert reason == "stop"
        jsonschema.validate(json.loads(tok.decode(tokens)), schema)


def test_a_speculative_step_adds_no_host_wait(engine: DecodeEngine) -> None:
    """Every rank's host waits per step (`tpla bench decode-step`'s count), the leader's
    drafting, processing and acceptance included: the same with drafts as without."""
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    counts: list[int] = []
    engine.probe.on_step = lambda _s, _b: counts.append(engine.probe.last_host_syncs)
    engine.probe.count_syncs = True
    try:
        _run(engine, PLAIN, [REPEATING], [greedy])
        plain, counts[:] = set(counts), []
        before = engine.probe.acceptance.drafted
        _run(engine, NGRAM, [REPEATING], [greedy])
        assert engine.probe.acceptance.drafted > before
    finally:
        engine.probe.count_syncs = False
        engine.probe.on_step = None
    assert set(counts) == plain and max(plain) <= 2
