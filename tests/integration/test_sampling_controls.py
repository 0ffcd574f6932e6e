"""Sampling controls and grammars in the real decode engine (multi-process rank groups), in
the TPLA, MLA-TP and SP layouts: every decoded token is the one the naive per-token
implementation picks from that step's raw logits and the sequence's own history, whatever
else shares the batch; grammars hold from the first token on; blocks are all free after."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
import torch

from common.loading.serving_model import load_prefill_model
from common.sampling.grammar import GrammarKind, GrammarSpec
from common.sampling.params import SamplingParams
from common.text.tokenizer import Tokenizer
from services.decode.engine import DecodeEngine
from tests.tiny import save_tiny_chat_model
from tests.tiny_engines import TINY_LAYOUTS, tiny_engine
from tools.local_driver import collect, submit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("controls-model"), std=0.08)


@pytest.fixture(scope="module", params=list(TINY_LAYOUTS))
def engine(request: pytest.FixtureRequest, model_dir: Path):
    with tiny_engine(model_dir, TINY_LAYOUTS[request.param], record_logits=True) as eng:
        yield eng


def _naive_pick(raw: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> int:
    """Greedy after the controls, one token at a time in plain Python."""
    counts = Counter(output)
    best, best_score = -1, -math.inf
    bias = dict(p.logit_bias)
    stops = p.stop_ids((1,))
    for t, x in enumerate(raw):
        if p.min_tokens and len(output) < p.min_tokens and t in stops:
            continue
        x += bias.get(t, 0.0)
        if counts[t] or (p.repetition_penalty != 1.0 and t in prompt):
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        x -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
        if x > best_score:
            best, best_score = t, x
    return best


def test_penalties_per_sequence_in_a_shared_batch(engine: DecodeEngine) -> None:
    prompts = [[5, 9, 9, 14, 30, 31, 7], [40, 41, 42, 43], [60, 61, 60, 61, 60], [3, 4]]
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, frequency_penalty=1.5),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.8),
        SamplingParams(
            max_tokens=10,
            temperature=0.0,
            presence_penalty=2.0,
            min_tokens=6,
            logit_bias=((8, 3.0),),
        ),
    ]
    prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
    plain_alone = collect(*submit(engine, prefill, [prompts[0]], [params[0]])[0]).token_ids
    results = [collect(*s) for s in submit(engine, prefill, prompts, params)]
    assert results[0].token_ids == plain_alone
    for prompt, p, result in zip(prompts, params, results, strict=True):
        tokens = result.token_ids
        # Event k's logits fed tokens[k]; the token it sampled is tokens[k + 1].
        for k, event in enumerate(e for e in result.events if e.token is not None):
            picked = _naive_pick(event.logits.tolist(), p, prompt, tokens[: k + 1])
            assert tokens[k + 1] == picked, (p, k)
    load = engine.load()
    assert (load.running, load.waiting, load.reserved, load.blocks_used) == (0, 0, 0, 0)


def test_grammars_from_the_first_token(engine: DecodeEngine, model_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir)
    schema = {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    specs = [
        GrammarSpec.json_schema(schema),
        GrammarSpec(GrammarKind.REGEX, r"[0-9]{2}-[a-c]{3}"),
        GrammarSpec(GrammarKind.CHOICE, json.dumps(["alpha", "beta"])),
    ]
    params = [
        SamplingParams(max_tokens=48, temperature=0.8, seed=s, grammar=g)
        for s, g in enumerate(specs)
    ]
    prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
    results = [collect(*s) for s in submit(engine, prefill, [[5, 6, 7]] * 3, params)]
    texts = [tok.decode(r.token_ids) for r in results]
    assert all(r.finish_reason == "stop" for r in results), [r.finish_reason for r in results]
    jsonschema.validate(json.loads(texts[0]), schema)
    assert texts[1][:2].isdigit() and texts[1][2] == "-" and set(texts[1][3:]) <= set("abc")
    assert texts[2] in ("alpha", "beta")
    load = engine.load()
    assert (load.running, load.blocks_used) == (0, 0)


def test_huge_logit_bias_forces_every_token(engine: DecodeEngine) -> None:
    p = SamplingParams(
        max_tokens=6, temperature=1.0, seed=1, ignore_eos=True, logit_bias=((77, 100.0),)
    )
    prefill = load_prefill_model(engine.cfg.model, engine.cfg.reparam)
    result = collect(*submit(engine, prefill, [[9, 10, 11]], [p])[0])
    assert result.token_ids == [77] * 6
    assert torch.isfinite(torch.tensor([e.token.logprob for e in result.events if e.token])).all()
