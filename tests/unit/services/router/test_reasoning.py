"""Reasoning split from content (services/router/reasoning.py): the streamed splitter agrees
with the whole-text split on every prefix of a set of outputs, fed a character at a time and
in random pieces; a request thinks as its prompt and its family say; the families are picked
by the model and named as vLLM and SGLang name them."""

from __future__ import annotations

import random

import pytest

from services.router.reasoning import (
    ReasoningFamily,
    ReasoningSplitter,
    family,
    parser_name,
    split,
    thinks,
)

OUTPUTS = [
    "Let me think.</think>The answer is 4.",
    "<think>\nOkay, 2+2.\n</think>\n\n4",
    "\n\n<think>reasoning</think>answer",
    "reasoning cut off before it ends",
    "<thi",  # a start marker cut off
    "reasoning </thin",  # an end marker cut off
    "a < b and c </ d </think> x </think> y",
    "</think>",
    "",
    "  ",
    "<think></think>",
    "no <think> here first</think>content <think> stays",
]


def _streamed(text: str, thinking: bool, pieces: list[str]) -> tuple[str, str]:
    splitter = ReasoningSplitter(thinking)
    reasoning = content = ""
    for piece in pieces:
        r, c = splitter.push(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("text", OUTPUTS)
@pytest.mark.parametrize("thinking", [True, False])
def test_streamed_split_equals_the_whole_split_on_every_prefix(text: str, thinking: bool) -> None:
    rng = random.Random(len(text))
    for end in range(len(text) + 1):
        prefix = text[:end]
        expected = split(prefix, thinking)
        assert _streamed(prefix, thinking, list(prefix)) == expected, prefix
        cuts = sorted(rng.sample(range(1, end), min(3, end - 1))) if end > 1 else []
        pieces = [prefix[a:b] for a, b in zip([0, *cuts], [*cuts, end], strict=True)]
        assert _streamed(prefix, thinking, pieces) == expected, (prefix, pieces)


def test_what_goes_where() -> None:
    assert split("<think>\nhm</think>\n\n4", True) == ("\nhm", "\n\n4")
    assert split("cut off", True) == ("cut off", "")
    assert split("<think>a</think>b", False) == ("", "<think>a</think>b")
    splitter = ReasoningSplitter(True)
    assert splitter.reasoning and splitter.push("<think>ab</th") == ("ab", "")
    assert splitter.push("ink>cd") == ("", "cd") and not splitter.reasoning


@pytest.mark.parametrize(
    ("fam", "tail", "expected"),
    [
        (ReasoningFamily.DEEPSEEK_V3, "<｜Assistant｜><think>", True),
        (ReasoningFamily.DEEPSEEK_V3, "<｜Assistant｜></think>", False),
        (ReasoningFamily.DEEPSEEK_V3, "<｜tool▁output▁end｜>", False),
        (ReasoningFamily.DEEPSEEK_R1, "<｜Assistant｜><think>\n", True),
        (ReasoningFamily.DEEPSEEK_R1, "<｜Assistant｜>", True),
        (ReasoningFamily.GLM45, "<|assistant|>", True),
        (ReasoningFamily.GLM45, "<|assistant|>\n<think></think>", False),
        (ReasoningFamily.KIMI_K2, "<|im_assistant|>assistant<|im_middle|>", True),
    ],
)
def test_a_request_thinks_as_its_prompt_ends(
    fam: ReasoningFamily, tail: str, expected: bool
) -> None:
    assert thinks(fam, tail) is expected


def test_families_by_name_and_by_model() -> None:
    for name in ("deepseek-r1", "DeepSeek_R1", " deepseek_r1 "):
        assert family(name, "", frozenset()) is ReasoningFamily.DEEPSEEK_R1
    assert family("deepseek-v3", "", frozenset()) is ReasoningFamily.DEEPSEEK_V3
    assert family("kimi", "", frozenset()) is ReasoningFamily.KIMI_K2
    assert family("none", "deepseek_v32", frozenset({"</think>"})) is None
    assert parser_name("") == "none" and parser_name("AUTO") == "auto"
    with pytest.raises(ValueError, match="deepseek_r1"):
        parser_name("qwen3")
    mentions = frozenset({"</think>"})
    assert family("auto", "deepseek_v2", frozenset()) is None  # the demo: no think markers
    assert family("auto", "deepseek_v3", frozenset()) is None  # DeepSeek-V3-0324
    assert family("auto", "deepseek_v3", mentions) is ReasoningFamily.DEEPSEEK_R1
    v31 = mentions | {"thinking"}
    assert family("auto", "deepseek_v3", v31) is ReasoningFamily.DEEPSEEK_V3
    assert family("auto", "deepseek_v32", frozenset()) is ReasoningFamily.DEEPSEEK_V3
    assert family("auto", "glm4_moe", v31) is ReasoningFamily.GLM45
    assert family("auto", "kimi_k2", mentions) is ReasoningFamily.KIMI_K2
    kimi_template = mentions | {"<|im_assistant|>"}
    assert family("auto", "deepseek_v3", kimi_template) is ReasoningFamily.KIMI_K2
