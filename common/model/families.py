"""The MLA model families this engine serves: one registry from a checkpoint's `model_type` to
what that family switches on, so a new family is a table entry plus its differences.

A family's `normalize` turns its HF `config.json` into the DeepSeek-V3 key set that
`ModelConfig.from_hf_dict` reads (legacy keys renamed, a multimodal wrapper's `text_config`
lifted out, defaults that differ from V3's filled in); what the family does differently in the
math is a feature of `ModelConfig` that the family's `normalize` sets, never a check of the
family's name in the model code. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

RawConfig = dict[str, Any]


class UnknownFamily(ValueError):
    """A `model_type` no family here serves."""


def _deepseek_v2(raw: RawConfig) -> RawConfig:
    # V2 checkpoints route greedily over softmax scores unless they say otherwise.
    return {"topk_method": "greedy", "scoring_func": "softmax", **_present(raw)}


def _deepseek_v3(raw: RawConfig) -> RawConfig:
    return {"topk_method": "noaux_tc", "scoring_func": "sigmoid", **_present(raw)}


def _present(raw: RawConfig) -> RawConfig:
    """`raw` without its null values (a null means "the family's default")."""
    return {k: v for k, v in raw.items() if v is not None}


@dataclass(frozen=True)
class Family:
    """One family of MLA checkpoints."""

    name: str
    model_types: tuple[str, ...]
    # The HF transformers model the family is held exact against (tests), as a module path.
    reference: str
    # The family's config.json -> the V3 key set ModelConfig reads.
    normalize: Callable[[RawConfig], RawConfig] = field(default=_present)


FAMILIES: tuple[Family, ...] = (
    Family("DeepSeek-V2", ("deepseek_v2",), "transformers.models.deepseek_v2", _deepseek_v2),
    Family("DeepSeek-V3", ("deepseek_v3",), "transformers.models.deepseek_v3", _deepseek_v3),
)


def model_types() -> tuple[str, ...]:
    """Every `model_type` served, in the registry's order."""
    return tuple(t for f in FAMILIES for t in f.model_types)


def family_of(model_type: str | None) -> Family:
    """The family serving `model_type`; UnknownFamily naming the ones served."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise UnknownFamily(f"model_type {model_type!r} is not one of {model_types()}")
