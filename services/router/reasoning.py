"""Reasoning models' output split into reasoning and answer (pure logic): which model family
thinks how, whether a request thinks, and the split itself, whole (`split`) or streamed
(`ReasoningSplitter`, held equal to `split` on every prefix of a text by its tests).

Families (`TPLA_REASONING_PARSER` names one, with `_` or `-`; `auto` picks by the model):
    deepseek_r1  DeepSeek-R1: always thinks (its template opens <think>, or the model does)
    deepseek_v3  DeepSeek-V3.1 / V3.2: thinks when the template variable `thinking` (or
                 `enable_thinking`) is true: the prompt then ends with <think>
    glm45        GLM-4.5 and later: thinks unless `enable_thinking` is false (the prompt then
                 closes an empty <think></think>); the model opens <think> itself
    kimi_k2      Kimi K2-Thinking: always thinks; the model opens <think> itself
All of them mark the reasoning <think> ... </think>. A request thinks when its prompt ends
with <think> (the template opened it), not when it ends with </think> (the template closed
it), and otherwise as its family does (R1, GLM and Kimi: yes; V3.x: no). A thinking request's
output is reasoning up to </think> (a <think> the model writes first is dropped) and content
after it; cut off before </think>, all of it is reasoning. One that does not think is all
content. The decode side follows the same rule by token (common/sampling/thinking.py): a
grammar starts after </think>, and a thinking budget forces it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.router.stops import partial_suffix

START = "<think>"
END = "</think>"
_WHITESPACE = " \t\r\n"


class ReasoningFamily(enum.Enum):
    DEEPSEEK_R1 = "deepseek_r1"
    DEEPSEEK_V3 = "deepseek_v3"
    GLM45 = "glm45"
    KIMI_K2 = "kimi_k2"

    @property
    def thinks_by_default(self) -> bool:
        """Whether a prompt that neither opens nor closes <think> thinks."""
        return self is not ReasoningFamily.DEEPSEEK_V3


# The names the anchors give the families (vLLM's --reasoning-parser, SGLang's), `_` for `-`.
_NAMES = {
    "deepseek_r1": ReasoningFamily.DEEPSEEK_R1,
    "deepseek_v3": ReasoningFamily.DEEPSEEK_V3,
    "deepseek_v31": ReasoningFamily.DEEPSEEK_V3,
    "deepseek_v32": ReasoningFamily.DEEPSEEK_V3,
    "glm45": ReasoningFamily.GLM45,
    "kimi_k2": ReasoningFamily.KIMI_K2,
    "kimi": ReasoningFamily.KIMI_K2,
}
AUTO, OFF = "auto", "none"


def parser_name(value: str) -> str:
    """`TPLA_REASONING_PARSER` as one of auto, none or a family's name; ValueError naming the
    accepted ones otherwise."""
    name = value.strip().lower().replace("-", "_") or OFF
    if name in (AUTO, OFF) or name in _NAMES:
        return name
    raise ValueError(
        f"TPLA_REASONING_PARSER={value!r}: expected auto, none or one of {sorted(_NAMES)}"
    )


def family(setting: str, model_type: str, mentions: frozenset[str]) -> ReasoningFamily | None:
    """The reasoning family a model is served with: the setting's, or (auto) the one its
    config.json `model_type` and chat template say; None when it does not reason (its
    template never writes </think>: the demo's, DeepSeek-V3's). `mentions`: which of
    </think>, `thinking` and <|im_assistant|> its template mentions."""
    name = parser_name(setting)
    if name == OFF:
        return None
    if name != AUTO:
        return _NAMES[name]
    if model_type == "deepseek_v32":
        return ReasoningFamily.DEEPSEEK_V3
    if END not in mentions:
        return None
    if model_type.startswith("glm"):
        return ReasoningFamily.GLM45
    if model_type == "kimi_k2" or "<|im_assistant|>" in mentions:
        return ReasoningFamily.KIMI_K2
    if "thinking" in mentions:
        return ReasoningFamily.DEEPSEEK_V3
    return ReasoningFamily.DEEPSEEK_R1


# What `family` asks of a template.
TEMPLATE_MARKS = (END, "thinking", "<|im_assistant|>")


@dataclass(frozen=True)
class ModelReasoning:
    """How the served model reasons (decided once, at start-up)."""

    family: ReasoningFamily
    end_id: int  # the token </think> is: the workers' think-end token
    # Whether the markers are special tokens, which the text keeps only when special tokens
    # are not skipped.
    special: bool


def thinks(fam: ReasoningFamily, prompt_tail: str) -> bool:
    """Whether a request whose prompt ends with `prompt_tail` starts by thinking."""
    tail = prompt_tail.rstrip(_WHITESPACE)
    if tail.endswith(START):
        return True
    if tail.endswith(END):
        return False
    return fam.thinks_by_default


def split(text: str, thinking: bool) -> tuple[str, str]:
    """A whole output's (reasoning, content)."""
    if not thinking:
        return "", text
    stripped = text.lstrip(_WHITESPACE)
    if stripped.startswith(START):
        text = stripped[len(START) :]
    reasoning, end, content = text.partition(END)
    return reasoning, content if end else ""


class _At(enum.Enum):
    OPENING = "opening"  # nothing but whitespace yet: a <think> may still come first
    REASONING = "reasoning"
    CONTENT = "content"


@dataclass
class ReasoningSplitter:
    """A streamed output's (reasoning, content): `push` each text delta, then `finish`.

    Text that may still be (the start of) a marker is held back until the next delta decides
    it, as stop strings are (stops.py)."""

    thinking: bool
    _held: str = ""

    def __post_init__(self) -> None:
        self._at = _At.OPENING if self.thinking else _At.CONTENT

    @property
    def reasoning(self) -> bool:
        """Whether the output is still in its reasoning."""
        return self._at is not _At.CONTENT

    def push(self, text: str) -> tuple[str, str]:
        """The reasoning and the content `text` lets go out now (either may be empty)."""
        if self._at is _At.CONTENT:
            return "", text
        buf = self._held + text
        self._held = ""
        if self._at is _At.OPENING:
            stripped = buf.lstrip(_WHITESPACE)
            if not stripped or (len(stripped) < len(START) and START.startswith(stripped)):
                self._held = buf  # a <think> may still come
                return "", ""
            self._at = _At.REASONING
            buf = stripped[len(START) :] if stripped.startswith(START) else buf
        reasoning, end, content = buf.partition(END)
        if end:
            self._at = _At.CONTENT
            return reasoning, content
        keep = partial_suffix(reasoning, (END,))
        self._held = reasoning[len(reasoning) - keep :]
        return reasoning[: len(reasoning) - keep], ""

    def finish(self) -> tuple[str, str]:
        """The end of the output: what was held back (reasoning, or content not thinking)."""
        held, self._held = self._held, ""
        if self._at is _At.CONTENT:
            return "", held
        return held, ""
