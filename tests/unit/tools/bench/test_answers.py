"""`tpla bench answers`: its batched generation against `generate`, and its scoring."""

from __future__ import annotations

import pytest

from common.loading.loader import load_model
from common.model.generate import generate
from common.sampling.params import SamplingParams
from tests.tiny import save_hf
from tools.bench.answers import Setting, generate_batch, grid, parses, repeated_lines

EOS = (1,)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("answers-model")
    save_hf("v2-greedy", path)
    return load_model(path)


PROMPTS = [[5, 9, 2, 33, 7], [12, 4], [3, 3, 8, 40, 41, 42, 43, 44, 45]]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=12, temperature=0.0),
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=3),
    ],
)
def test_batched_rows_are_what_generate_makes(model, params: SamplingParams) -> None:
    rows = [params, SamplingParams(max_tokens=7, temperature=0.0), params]
    got = generate_batch(model, PROMPTS, rows, EOS)
    for prompt, p, (ids, reason) in zip(PROMPTS, rows, got, strict=True):
        want = generate(model, prompt, p, eos_ids=EOS)
        assert (ids, reason) == (want.token_ids, want.finish_reason)


def test_a_penalized_row_is_the_same_in_any_batch(model) -> None:
    penalized = SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.5)
    alone = generate_batch(model, PROMPTS[:1], [penalized], EOS)
    batched = generate_batch(
        model, PROMPTS, [penalized, SamplingParams(max_tokens=4), penalized], EOS
    )
    assert batched[0] == alone[0]


def test_scoring() -> None:
    assert parses("def f(x):\n    return x\n", finished=True)
    assert not parses("def f(x:\n", finished=True)
    # Cut off: parsed up to its last complete line.
    assert parses("def f(x):\n    return x\n    y = (1,", finished=False)
    assert not parses("def f(", finished=False)
    assert repeated_lines("a\nb\na\n\na\n") == pytest.approx(0.5)
    assert repeated_lines("") == 0.0
    settings = grid([0.0, 0.5], [1.0, 0.9], [1.0])
    assert settings == [Setting(0.0, 1.0), Setting(0.5, 1.0), Setting(0.5, 0.9)]
