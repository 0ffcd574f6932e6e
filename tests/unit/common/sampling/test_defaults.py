"""The model's sampling defaults: generation_config.json, the operator's overrides on top, and a
request's own values over both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.runtime.errors import GenerationConfigError
from common.sampling.defaults import SERVER_MAX_TOKENS, GenerationDefaults, Sampling, load_defaults

DEEPSEEK_V3 = {  # the sampling part of DeepSeek-V3's generation_config.json, and its ids
    "_from_model_config": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
    "transformers_version": "4.46.3",
}
SERVER = Sampling(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)


def model_dir(tmp_path: Path, config: dict[str, Any] | str | None) -> Path:
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        (tmp_path / "generation_config.json").write_text(text)
    return tmp_path


def test_the_file_gives_the_defaults(tmp_path: Path) -> None:
    d = load_defaults(model_dir(tmp_path, DEEPSEEK_V3))
    assert d.sampling() == Sampling(0.6, 0.95, 0, 0.0, 1.0)
    assert d.max_tokens is None and d.max_tokens_for(1000) == SERVER_MAX_TOKENS
    assert d.source == str(tmp_path / "generation_config.json")


def test_every_field_is_read(tmp_path: Path) -> None:
    config = {
        "temperature": 0.3,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "max_new_tokens": 128,
    }
    d = load_defaults(model_dir(tmp_path, config))
    assert d.sampling() == Sampling(0.3, 0.9, 40, 0.05, 1.1)
    assert d.max_tokens_for(1000) == 128 and d.max_tokens_for(100) == 100


def test_a_request_value_always_wins(tmp_path: Path) -> None:
    d = load_defaults(model_dir(tmp_path, {**DEEPSEEK_V3, "top_k": 20, "min_p": 0.1}))
    given = d.sampling(temperature=1.0, top_p=0.5, top_k=-1, min_p=0.0, repetition_penalty=1.2)
    assert given == Sampling(1.0, 0.5, 0, 0.0, 1.2)
    # 0 is a value, not "left out".
    assert d.sampling(temperature=0.0).temperature == 0.0
    assert d.sampling(top_p=0.8) == Sampling(0.6, 0.8, 20, 0.1, 1.0)


def test_do_sample_false_is_greedy(tmp_path: Path) -> None:
    d = load_defaults(model_dir(tmp_path, {"do_sample": False, "temperature": 0.7, "top_p": 0.9}))
    assert d.sampling().temperature == 0.0
    assert d.sampling(temperature=0.7).temperature == 0.7


def test_no_file_and_none_are_the_server_defaults(tmp_path: Path) -> None:
    assert load_defaults(model_dir(tmp_path, None)).sampling() == SERVER
    d = load_defaults(model_dir(tmp_path, DEEPSEEK_V3), "none")
    assert d.sampling() == SERVER and d == GenerationDefaults(source=d.source)
    assert "none" in d.source
    # Keys that are no sampling default (ids, HF's bookkeeping, null fields) change nothing.
    plain = {"bos_token_id": 0, "eos_token_id": [1, 2], "top_k": None, "use_cache": True}
    assert load_defaults(model_dir(tmp_path, plain)).sampling() == SERVER


def test_overrides_go_over_the_file(tmp_path: Path) -> None:
    path = model_dir(tmp_path, DEEPSEEK_V3)
    d = load_defaults(path, '{"temperature": 0.2, "max_new_tokens": 64}')
    assert d.sampling() == Sampling(0.2, 0.95, 0, 0.0, 1.0) and d.max_tokens == 64
    assert d.source.endswith(" + TPLA_GENERATION_CONFIG")
    assert load_defaults(path, '{"do_sample": false}').sampling().temperature == 0.0
    # Without a file, the overrides alone.
    assert load_defaults(tmp_path / "nothing-here", '{"top_k": 5}').sampling().top_k == 5


def test_an_override_of_temperature_replaces_the_files_do_sample(tmp_path: Path) -> None:
    path = model_dir(tmp_path, {"do_sample": False, "temperature": 0.7})
    assert load_defaults(path, '{"temperature": 0.4}').sampling().temperature == 0.4
    assert load_defaults(path, '{"do_sample": true}').sampling().temperature == 0.7
    # do_sample false in the overrides themselves is greedy whatever they say.
    both = '{"do_sample": false, "temperature": 0.4}'
    assert load_defaults(path, both).sampling().temperature == 0.0


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ("{not json", "auto, none or a JSON object"),
        ("[1, 2]", "JSON object"),
        ("sample", "auto, none or a JSON object"),
        ('{"temp": 0.5}', r"unknown keys \['temp'\]"),
        ('{"temperature": 3}', r"temperature must be in \[0, 2\]"),
        ('{"temperature": "0.5"}', "temperature must be a number"),
        ('{"temperature": true}', "temperature must be a number"),
        ('{"top_p": 0}', r"top_p must be in \(0, 1\]"),
        ('{"top_k": 1.5}', "top_k must be an integer"),
        ('{"top_k": -2}', "top_k must be an integer >= -1"),
        ('{"max_new_tokens": 0}', "max_new_tokens must be an integer >= 1"),
        ('{"do_sample": "yes"}', "do_sample must be true or false"),
        ('{"repetition_penalty": NaN}', "repetition_penalty must be in"),
    ],
)
def test_a_bad_override_is_refused(tmp_path: Path, setting: str, match: str) -> None:
    with pytest.raises(GenerationConfigError, match=match) as info:
        load_defaults(model_dir(tmp_path, None), setting)
    assert "TPLA_GENERATION_CONFIG" in str(info.value)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{", "not a readable JSON file"),
        ("[]", "must hold a JSON object"),
        ('{"temperature": -1}', r"temperature must be in \[0, 2\]"),
        ('{"min_p": 2.0}', r"min_p must be in \[0, 1\]"),
        ('{"max_new_tokens": 1.5}', "max_new_tokens must be an integer"),
    ],
)
def test_a_bad_file_is_refused(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(GenerationConfigError, match=match) as info:
        load_defaults(model_dir(tmp_path, text))
    assert "generation_config.json" in str(info.value)


def test_describe_names_every_default_and_its_source(tmp_path: Path) -> None:
    line = load_defaults(model_dir(tmp_path, DEEPSEEK_V3)).describe()
    assert "temperature=0.6" in line and "top_p=0.95" in line and "generation_config" in line
    assert f"max_tokens={SERVER_MAX_TOKENS}" in line
