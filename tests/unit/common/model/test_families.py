"""The family registry (common/model/families.py): every model_type served maps to one family,
an unknown one is refused naming those served, and a family fills in its own defaults."""

from __future__ import annotations

import pytest

from common.model.args import ConfigError, ModelConfig
from common.model.families import FAMILIES, UnknownFamily, family_of, model_types


def test_each_model_type_has_one_family() -> None:
    assert len(model_types()) == len(set(model_types()))
    for family in FAMILIES:
        for model_type in family.model_types:
            assert family_of(model_type) is family
    with pytest.raises(UnknownFamily, match=r"'llama' is not one of .*deepseek_v3"):
        family_of("llama")


def test_a_family_fills_in_its_defaults_and_a_null_is_a_default() -> None:
    assert family_of("deepseek_v2").normalize({"scoring_func": None})["scoring_func"] == "softmax"
    v3 = family_of("deepseek_v3").normalize({"topk_method": None, "n_group": 8})
    assert (v3["topk_method"], v3["scoring_func"], v3["n_group"]) == ("noaux_tc", "sigmoid", 8)
    # A checkpoint's own value wins over the family's default.
    assert family_of("deepseek_v3").normalize({"scoring_func": "softmax"})["scoring_func"] == (
        "softmax"
    )


def test_the_config_parser_refuses_an_unknown_family() -> None:
    with pytest.raises(ConfigError, match="model_type 'mistral' is not one of"):
        ModelConfig.from_hf_dict({"model_type": "mistral"})
