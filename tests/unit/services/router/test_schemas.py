"""Bad requests -> 4xx OpenAI error bodies, checked through the app (no workers needed: every
case is rejected before Redis or gRPC is touched, so the Redis URL is never dialled)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from services.router.chat_schemas import ChatCompletionRequest
from services.router.completion_schemas import CompletionRequest
from tests.router_rig import MAX_POSITIONS, chat

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (chat(n=0), "n", "greater than or equal to 1"),
        (chat(n=129), "n", "less than or equal to 128"),
        (chat(temperature=2.5), "temperature", "less than or equal to 2"),
        (chat(top_p=0), "top_p", "greater than 0"),
        (chat(max_tokens=0), "max_tokens", "greater than or equal to 1"),
        (chat(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
        (chat(top_logprobs=3), None, "requires logprobs"),
        (chat(messages=[]), "messages", "at least 1"),
        (chat(messages=[{"role": "robot", "content": "x"}]), "messages.0.role", "'system'"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
            "messages.0.content",
            "only 'text'",
        ),
        (chat(stream_options={"include_usage": True}), None, "only allowed when stream"),
        (chat(presence_penalty=2.5), "presence_penalty", "less than or equal to 2"),
        (chat(frequency_penalty=-2.1), "frequency_penalty", "greater than or equal to -2"),
        (chat(repetition_penalty=0), "repetition_penalty", "greater than 0"),
        (chat(min_p=1.5), "min_p", "less than or equal to 1"),
        (chat(min_tokens=-1), "min_tokens", "greater than or equal to 0"),
        (chat(max_tokens=4, min_tokens=5), "min_tokens", "must not exceed max_tokens"),
        (chat(top_k=-2), "top_k", "greater than or equal to -1"),
        (chat(logit_bias={"5": 101}), "logit_bias", "[-100, 100]"),
        (chat(logit_bias={"x": 1}), "logit_bias", "token ids"),
        (chat(logit_bias={"99999": 1}), "logit_bias", "outside the vocabulary"),
        (chat(stop_token_ids=[99999]), "stop_token_ids", "outside the vocabulary"),
        (chat(stop_token_ids=[-1]), "stop_token_ids.0", "greater than or equal to 0"),
        (
            chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "bogus"}},
                }
            ),
            "response_format",
            "bogus",
        ),
        (
            chat(response_format={"type": "json_schema"}),
            "response_format",
            "json_schema is required",
        ),
        (chat(response_format={"type": "yaml"}), "response_format.type", "json_object"),
        (
            {"model": "tpla-test", "prompt": "x", "structured_outputs": {"choice": [1]}},
            "structured_outputs.choice.0",
            "string",
        ),
        (
            {
                "model": "tpla-test",
                "prompt": "x",
                "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
                "ignore_eos": True,
            },
            "ignore_eos",
            "structured output",
        ),
        (chat(structured_outputs={"regex": "[a-"}), "structured_outputs", "regex"),
        (chat(structured_outputs={"choice": []}), "structured_outputs.choice", "at least 1"),
        (
            chat(structured_outputs={"regex": "a", "choice": ["b"]}),
            "structured_outputs",
            "exactly one",
        ),
        (chat(structured_outputs={"json": "{not json"}), "structured_outputs", "not valid JSON"),
        (
            chat(response_format={"type": "json_object"}, ignore_eos=True),
            "ignore_eos",
            "structured output",
        ),
        ({"model": "tpla-test", "prompt": ["a", [1]]}, "prompt", "a batch of prompts"),
        ({"model": "tpla-test", "prompt": [[1], []]}, "prompt", "a batch of prompts"),
        ({"model": "tpla-test", "prompt": 3}, "prompt", "list of token ids"),
        ({"model": "tpla-test", "prompt": ["a"] * 65}, "prompt", "at most 64"),
        ({"model": "tpla-test", "prompt": ["a"] * 3, "n": 50}, None, "over 128 choices"),
        ({"model": "tpla-test", "prompt": "x", "best_of": 3}, "best_of", "not supported"),
        ({"model": "tpla-test", "prompt": "x", "suffix": "y"}, "suffix", "not supported"),
    ],
)
async def test_invalid_params_are_400(
    client: httpx.AsyncClient, body: dict[str, Any], param: str | None, fragment: str
) -> None:
    route = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    resp = await client.post(route, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert fragment in error["message"]


async def test_unknown_model_is_404(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/chat/completions", json=chat(model="gpt-4"))
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found"


async def test_context_limits(client: httpx.AsyncClient) -> None:
    long_prompt = list(range(10, 10 + MAX_POSITIONS))
    resp = await client.post("/v1/completions", json={"model": "tpla-test", "prompt": long_prompt})
    assert resp.status_code == 400
    assert f"maximum context length is {MAX_POSITIONS} tokens" in resp.json()["error"]["message"]
    body = {"model": "tpla-test", "prompt": [5, 6], "max_tokens": MAX_POSITIONS}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
    resp = await client.post("/v1/completions", json={"model": "tpla-test", "prompt": [10**6]})
    assert resp.status_code == 400 and "outside the vocabulary" in resp.json()["error"]["message"]


async def test_transport_level_errors(client: httpx.AsyncClient) -> None:
    bad_json = await client.post(
        "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert bad_json.status_code == 400
    assert bad_json.json()["error"]["message"] == "request body is not valid JSON"
    text = await client.post(
        "/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"}
    )
    assert text.status_code == 415
    assert text.json()["error"]["type"] == "invalid_request_error"
    huge = await client.post("/v1/completions", json={"model": "tpla-test", "prompt": "x" * 2**20})
    assert huge.status_code == 413
    missing = await client.get("/v1/nothing-here")
    assert missing.status_code == 404 and "error" in missing.json()
    assert (await client.get("/v1/chat/completions")).status_code == 405


def test_models_convert_cleanly() -> None:
    req = ChatCompletionRequest.model_validate(
        chat(
            stop="x",
            max_completion_tokens=5,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
        )
    )
    assert req.stop_list == ("x",) and req.token_limit == 5 and req.messages[0].text == "ab"
    comp = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2], "stop": None})
    assert comp.stop_list == () and comp.token_limit is None and not comp.include_usage
    assert comp.prompts == [[1, 2]] and comp.choices == 1
    batch = CompletionRequest.model_validate({"model": "m", "prompt": [[1], [2, 3]], "n": 2})
    assert batch.prompts == [[1], [2, 3]] and batch.choices == 2
    texts = CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"], "echo": True})
    assert texts.prompts == ["a", "b"] and texts.echo


def test_developer_role_strict_types_and_unicode_at_the_model_level() -> None:
    req = ChatCompletionRequest.model_validate(
        chat(messages=[{"role": "developer", "content": "x"}], n=None, stream=None)
    )
    assert req.messages[0].template_role == "system" and req.messages[0].role == "developer"
    assert req.n is None and not req.stream and not req.include_usage
    for bad in (
        chat(max_tokens=True),
        chat(max_tokens="3"),
        chat(stream=1),
        chat(temperature=float("nan")),
        chat(messages=[{"role": "user", "content": "\udc00"}]),
        chat(tools=[{"type": "function"}]),
    ):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate(bad)
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": [1, False]})
