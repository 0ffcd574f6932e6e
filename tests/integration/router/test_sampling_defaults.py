"""The model's sampling defaults through the real router: a request that leaves a field out
gets the model's value, one that names it keeps its own, and GET /v1/models shows them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from common.text.tokenizer import Tokenizer
from tests.router_rig import Script, run_stack

pytestmark = pytest.mark.anyio

MODEL_DEFAULTS = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "max_new_tokens": 9}


@pytest.fixture
def tuned_model(model_dir: Path, tmp_path: Path) -> Path:
    """The rig's model with DeepSeek-style sampling defaults in its generation_config.json."""
    path = tmp_path / "model"
    shutil.copytree(model_dir, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, **MODEL_DEFAULTS}))
    return path


def _script(tok: Tokenizer) -> Script:
    return Script([*tok.encode("one two three"), min(tok.eos_token_ids)])


async def test_requests_get_the_models_defaults_unless_they_name_a_value(
    tuned_model: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    async with run_stack(tuned_model, redis_url, _script(tokenizer)) as stack:
        chat = {"model": "tpla-test", "messages": [{"role": "user", "content": "hi"}]}
        bodies = [
            ("/v1/chat/completions", chat),
            ("/v1/completions", {"model": "tpla-test", "prompt": "hi"}),
            ("/v1/chat/completions", {**chat, "temperature": 0, "top_p": 0.5, "max_tokens": 20}),
            ("/v1/completions", {"model": "tpla-test", "prompt": "hi", "temperature": 1.0}),
        ]
        for path, body in bodies:
            resp = await stack.client.post(path, json=body)
            assert resp.status_code == 200, resp.text
        sent = [g.params for g in stack.decode.generated]
        assert [(p.temperature, p.top_p, p.max_tokens) for p in sent] == [
            (pytest.approx(0.6), pytest.approx(0.95), 9),
            (pytest.approx(0.6), pytest.approx(0.95), 9),
            (0.0, pytest.approx(0.5), 20),
            (1.0, pytest.approx(0.95), 9),
        ]

        card = (await stack.client.get("/v1/models")).json()["data"][0]
        assert card["id"] == "tpla-test" and card["object"] == "model"
        shown = card["sampling_defaults"]
        assert shown["temperature"] == 0.6 and shown["top_p"] == 0.95
        assert shown["top_k"] == 0 and shown["repetition_penalty"] == 1.0
        assert shown["max_tokens"] == 9
        assert shown["source"].endswith("generation_config.json")


async def test_the_operator_overrides_or_turns_off_the_defaults(
    tuned_model: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    chat = {"model": "tpla-test", "messages": [{"role": "user", "content": "hi"}]}
    for setting, temperature in (('{"temperature": 0.2}', 0.2), ("none", 1.0)):
        async with run_stack(
            tuned_model, redis_url, _script(tokenizer), generation_config=setting
        ) as stack:
            resp = await stack.client.post("/v1/chat/completions", json=chat)
            assert resp.status_code == 200, resp.text
            assert stack.decode.generated[0].params.temperature == pytest.approx(temperature)
            shown = (await stack.client.get("/v1/models")).json()["data"][0]["sampling_defaults"]
            assert shown["temperature"] == temperature


def test_a_bad_setting_stops_the_router_at_start(tuned_model: Path) -> None:
    from common.runtime.errors import GenerationConfigError
    from common.runtime.settings import Settings
    from services.router.app import create_app
    from tests.router_rig import UNUSED_REDIS

    settings = Settings(model=str(tuned_model), generation_config='{"temperature": 7}')
    with pytest.raises(GenerationConfigError, match="TPLA_GENERATION_CONFIG"):
        create_app(settings, redis_url=UNUSED_REDIS)
