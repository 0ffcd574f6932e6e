"""The serving benchmarks' prompts: distinct source windows, and edit prompts whose second
half is the model's own greedy continuation of the first (what their answers then repeat)."""

from __future__ import annotations

from pathlib import Path

from common.loading.serving_model import load_prefill_model
from common.model.generate import generate
from common.sampling.params import SamplingParams
from tools.bench.prompts import Mix, make_prompts, source_windows

DEMO = str(Path(__file__).resolve().parents[4] / "models" / "demo")


def test_windows_are_distinct_and_of_the_mix_length() -> None:
    prompts = make_prompts(DEMO, Mix("completion", 48, 16), 4)
    assert len({tuple(p) for p in prompts}) == 4
    assert all(len(p) == 48 for p in prompts)


def test_an_edit_prompt_is_a_window_then_the_model_writing_on() -> None:
    prompts = make_prompts(DEMO, Mix("edit", 40, 16), 2)
    windows = source_windows(DEMO, 20, 2)
    model = load_prefill_model(DEMO, "")
    for prompt, window in zip(prompts, windows, strict=True):
        assert len(prompt) == 40 and prompt[:20] == window
        greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        assert prompt[20:] == generate(model, window, greedy).token_ids
