"""Hostile and odd input -> 4xx OpenAI error bodies, never 5xx; harmless odd input -> 200;
and what a client sends stays out of the logs unless TPLA_LOG_PROMPTS is on.

Rejections are checked in-process through ASGI (they happen before Redis or gRPC is
touched); inputs that must be accepted run through the real stack of conftest.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.runtime.settings import Settings
from common.text.tokenizer import Tokenizer
from services.router.app import create_app
from tests.router_rig import UNUSED_REDIS, Script, chat, run_stack

pytestmark = pytest.mark.anyio

JSON = {"content-type": "application/json"}


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": "tpla-test", "prompt": "hi", **kw}


def route(body: dict[str, Any]) -> str:
    return "/v1/completions" if "prompt" in body else "/v1/chat/completions"


def raw(body: dict[str, Any]) -> bytes:
    # json.dumps writes lone surrogates as "\ud800" escapes, exactly as a hostile client can.
    return json.dumps(body).encode()


async def expect_400(
    client: httpx.AsyncClient, path: str, content: bytes, param: str | None, fragment: str
) -> None:
    resp = await client.post(path, content=content, headers=JSON)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert fragment in error["message"], error


SURROGATE = "a\ud800b"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(messages=[{"role": "user", "content": SURROGATE}]), "messages.0.content"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]),
            "messages.0.content.0.text",
        ),
        (chat(messages=[{"role": "user", "content": "x", "name": SURROGATE}]), "messages.0.name"),
        (chat(model=SURROGATE), "model"),
        (chat(stop=[SURROGATE]), "stop.0"),
        (chat(user=SURROGATE), "user"),
        (completion(prompt=SURROGATE), "prompt"),
        (completion(prompt="\udfff"), "prompt"),
    ],
)
async def test_lone_surrogates_are_400(
    client: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    # Before: the tokenizer (or the UTF-8 encoder of the error body) raised -> 500.
    await expect_400(client, route(body), raw(body), param, "valid Unicode")


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (chat(seed=10**30), "seed", "less than or equal to 9223372036854775807"),
        (chat(seed=-(10**30)), "seed", "greater than or equal to"),
        (chat(top_k=10**30), "top_k", "less than or equal to 2147483647"),
        (chat(max_tokens=10**30), "max_tokens", "maximum context length is 64 tokens"),
        (chat(max_completion_tokens=10**30), "max_tokens", "maximum context length"),
        (completion(prompt=[2**70]), "prompt", "outside the vocabulary"),
        (completion(logprobs=10**30), "logprobs", "less than or equal to 20"),
    ],
)
async def test_huge_numbers_are_400(
    client: httpx.AsyncClient, body: dict[str, Any], param: str, fragment: str
) -> None:
    # Before: seed and top_k overflowed the protobuf int64/int32 fields -> 500.
    await expect_400(client, route(body), raw(body), param, fragment)


@pytest.mark.parametrize(
    ("content", "param", "fragment"),
    [
        (b'{"model": "tpla-test", "prompt": "x", "temperature": NaN}', "temperature", "finite"),
        (b'{"model": "tpla-test", "prompt": "x", "top_p": Infinity}', "top_p", "finite"),
        (b'{"model": "tpla-test", "prompt": "x", "temperature": 1e999}', "temperature", "finite"),
        (b'{"model": "tpla-test", "prompt": "x", "max_tokens": -Infinity}', "max_tokens", ""),
        (
            b'{"model": "tpla-test", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
            None,
            "JSON",
        ),
        (b'{"model": "tpla-test", "prompt": "\xff\xfe"}', None, "not valid UTF-8 JSON"),
        (b"\xef\xbb\xbf\xc3\x28", None, "not valid"),
        (b"[" * 100_000 + b"]" * 100_000, None, "nested too deeply"),
        (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, None, "nested too deeply"),
        (b"", None, "Field required"),
        (b"null", None, "valid dictionary"),
        (b"[]", None, "valid dictionary"),
        (b'"prompt"', None, "valid dictionary"),
        (b'{"model": "tpla-test", "prompt": "x",}', None, "not valid JSON"),
    ],
)
async def test_malformed_bodies_are_400(
    client: httpx.AsyncClient, content: bytes, param: str | None, fragment: str
) -> None:
    await expect_400(client, "/v1/completions", content, param, fragment)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(n=True), "n"),
        (chat(max_tokens="5"), "max_tokens"),
        (chat(max_tokens=5.0), "max_tokens"),
        (chat(stream="true"), "stream"),
        (
            chat(stream_options={"include_usage": "yes"}, stream=True),
            "stream_options.include_usage",
        ),
        (chat(logprobs=1), "logprobs"),
        (chat(temperature="0.5"), "temperature"),
        (chat(messages=[{"role": "user", "content": None}]), "messages.0.content"),
        (chat(messages=[{"role": "user", "content": 5}]), "messages.0.content"),
        (chat(messages=["hi"]), "messages.0"),
        (chat(messages={"role": "user", "content": "hi"}), "messages"),
        (chat(model=["tpla-test"]), "model"),
        (completion(prompt=[True, 5]), "prompt"),
        (completion(prompt=[-1]), "prompt"),
        (completion(prompt=[]), "prompt"),
        (completion(prompt={"text": "x"}), "prompt"),
        (completion(logprobs=True), "logprobs"),
    ],
)
async def test_wrong_types_are_400(
    client: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    """Strict like OpenAI: no silent `true` -> 1, `"5"` -> 5 or `5.0` -> 5 coercion."""
    await expect_400(client, route(body), raw(body), param, "")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(functions=[{"name": "f"}]), "functions"),
        (chat(function_call="auto"), "function_call"),
        (chat(audio={"voice": "alloy", "format": "wav"}), "audio"),
        (chat(modalities=["text", "audio"]), "modalities"),
        (chat(prediction={"type": "content", "content": "x"}), "prediction"),
        (chat(web_search_options={}), "web_search_options"),
        (completion(best_of=2), "best_of"),
        (completion(suffix="}"), "suffix"),
    ],
)
async def test_unsupported_features_are_a_clear_400(
    client: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    # Before: these were silently ignored and the client got an answer it did not ask for.
    await expect_400(client, route(body), raw(body), param, "not supported")


async def test_unknown_model_is_404_and_not_echoed_in_full(client: httpx.AsyncClient) -> None:
    for model in ("gpt-4o", "x" * 100_000, "a\x00b"):
        resp = await client.post("/v1/chat/completions", json=chat(model=model))
        assert resp.status_code == 404, resp.text
        error = resp.json()["error"]
        assert (error["code"], error["param"], error["type"]) == (
            "model_not_found",
            "model",
            "not_found_error",
        )
        assert len(error["message"]) < 400


async def test_405_names_the_allowed_methods(client: httpx.AsyncClient) -> None:
    resp = await client.delete("/v1/chat/completions")
    assert resp.status_code == 405
    assert resp.headers["allow"] == "POST"
    assert resp.json()["error"]["type"] == "invalid_request_error"


async def test_content_types(client: httpx.AsyncClient) -> None:
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""):
        resp = await client.post(
            "/v1/completions", content=raw(completion()), headers={"content-type": ctype}
        )
        assert resp.status_code == 415, ctype
        assert resp.json()["error"]["code"] == "unsupported_media_type"


async def test_openapi_documents_openai_errors_not_422(client: httpx.AsyncClient) -> None:
    schema = (await client.get("/openapi.json")).json()
    error_ref = {"$ref": "#/components/schemas/ErrorBody"}
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            responses = op["responses"]
            assert "422" not in responses, (method, path)
            assert responses["500"]["content"]["application/json"]["schema"] == error_ref
    chat_op = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    for status in ("400", "401", "404", "413", "415", "429", "503", "504"):
        assert chat_op[status]["content"]["application/json"]["schema"] == error_ref, status
    assert set(chat_op["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "HTTPValidationError" not in schema["components"]["schemas"]


async def test_odd_but_valid_input_is_served(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    script = Script([*tokenizer.encode("ok"), min(tokenizer.eos_token_ids)])
    bodies = [
        chat(messages=[{"role": "user", "content": "NUL \x00 inside"}]),
        chat(messages=[{"role": "user", "content": "\u202eRTL \u200b zero-width \U0001f600 é"}]),
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\x00"}]}]),
        chat(n=None, stream=None, presence_penalty=None, frequency_penalty=None, seed=None),
        chat(tools=[], tool_choice="none", response_format={"type": "text"}, logit_bias={}),
        chat(parallel_tool_calls=False, modalities=["text"], functions=None),
        chat(seed=-(2**63), top_k=-1, unknown_field={"ignored": [1, 2]}),
        completion(prompt="\x00", best_of=1, suffix="", echo=None, n=1),
        completion(prompt=[0, 1, 2]),
    ]
    async with run_stack(model_dir, redis_url, script) as stack:
        for body in bodies:
            resp = await stack.client.post(route(body), content=raw(body), headers=JSON)
            assert resp.status_code == 200, (body, resp.text)
            assert resp.json()["choices"][0]["finish_reason"] == "stop"


async def test_developer_role_is_a_system_message(
    model_dir: Path, redis_url: str, tokenizer: Tokenizer
) -> None:
    """OpenAI's newer clients send "developer" where older ones send "system"."""
    script = Script([min(tokenizer.eos_token_ids)])
    async with run_stack(model_dir, redis_url, script) as stack:
        for role in ("developer", "system"):
            messages = [{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}]
            resp = await stack.client.post("/v1/chat/completions", json=chat(messages=messages))
            assert resp.status_code == 200, resp.text
        developer, system = [call for p in stack.prefills for call in p.calls]
        assert list(developer.prompt_ids) == list(system.prompt_ids)


@pytest.mark.parametrize("log_prompts", [False, True])
async def test_prompts_and_outputs_stay_out_of_logs_by_default(
    model_dir: Path,
    redis_url: str,
    tokenizer: Tokenizer,
    caplog: pytest.LogCaptureFixture,
    log_prompts: bool,
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, every level: nothing may slip through
    secret_prompt = "the confidential prompt zebra"
    output = "quick brown fox"
    script = Script([*tokenizer.encode(output), min(tokenizer.eos_token_ids)])
    async with run_stack(model_dir, redis_url, script, log_prompts=log_prompts) as stack:
        for body in (
            chat(messages=[{"role": "user", "content": secret_prompt}]),
            chat(messages=[{"role": "user", "content": secret_prompt}], stream=True),
            completion(prompt=secret_prompt),
        ):
            resp = await stack.client.post(route(body), json=body)
            assert resp.status_code == 200, resp.text
            assert body.get("stream") or output in resp.text
        # A rejected prompt is not logged either.
        too_long = completion(prompt=secret_prompt * 20)
        assert (await stack.client.post("/v1/completions", json=too_long)).status_code == 400
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert caplog.records  # the router did log (request lifecycle, access), just not content
    assert (secret_prompt in logged) is log_prompts
    assert (output in logged) is log_prompts


async def test_api_key_checks(model_dir: Path) -> None:
    """Bearer keys (compared as SHA-256 digests in constant time) guard /v1 and /admin."""
    settings = Settings(model=str(model_dir), served_model_name="tpla-test", api_keys="k-one, k2")
    app = create_app(settings, redis_url=UNUSED_REDIS)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        for auth in ("", "Bearer", "Bearer k-on", "Bearer k-one2", "Bearer K2", "Token k2", "k2"):
            resp = await client.get("/v1/models", headers={"Authorization": auth})
            assert resp.status_code == 401, auth
            assert resp.headers["www-authenticate"] == "Bearer"
            assert resp.json()["error"]["code"] == "invalid_api_key"
        for auth in ("Bearer k-one", "bearer  k2 "):
            assert (
                await client.get("/v1/models", headers={"Authorization": auth})
            ).status_code == 200
        # Rejected before the body is read: a bad key never reaches validation.
        resp = await client.post("/v1/completions", content=b"{nope", headers=JSON)
        assert resp.status_code == 401
