"""The request mixes clients send in the soak and in the tests that load the whole stack, and
how one request is sent and its answer judged.

`plain`: one chat turn, streamed or not, a short or a long prompt, 16-128 new tokens.
`chaos`: what real clients mix: n 1-3, streamed or not, a strict `json_schema`, a named tool,
shared system prompts (prefix caching), temperature 0 or 0.8, max_tokens 16-96. Every
structured answer that finished with "stop" must validate against what it was constrained to.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import jsonschema

SHORT = "Write a Python function that adds two numbers."
LONG = " ".join(
    f"def helper_{i}(x):\n    return x * {i} + {i * i}  # keep this in mind\n" for i in range(40)
)
SYSTEM_PROMPTS = (
    "You are a careful Python reviewer. Answer with code only, no prose, and keep it short.",
    "You are an assistant that fills in forms for a shipping company; be terse and exact.",
)
USER_PROMPTS = (SHORT, "Name a fruit and say if it is ripe.", "def parse(line):", "Summarize: ok")
PERSON_SCHEMA: dict = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
WEATHER_TOOL: dict = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@dataclass(frozen=True)
class MixRequest:
    body: dict
    # The JSON schema each choice's answer must satisfy when it finished with "stop" (the
    # content for a response_format, the call's arguments for a named tool); None: free text.
    schema: dict | None = None
    tool: bool = False


@dataclass
class Answer:
    """What one request got back, as a client sees it."""

    outcome: str  # completed | failed (a clean error) | lost (no answer, a broken stream)
    status: int = 0  # HTTP status (200 for a stream's in-band error)
    detail: str = ""  # the error's message, or why it was lost
    error_type: str = ""  # the error body's `type`
    error_code: str = ""
    texts: dict[int, str] = field(default_factory=dict)  # each choice's content or arguments
    finish: dict[int, str] = field(default_factory=dict)
    tokens: int = 0  # content or argument deltas received (a stream)

    def invalid(self, req: MixRequest) -> list[str]:
        """The choices that finished with "stop" but do not validate against the request's
        schema (each as `index: why`)."""
        if req.schema is None or self.outcome != "completed":
            return []
        bad = []
        for index, reason in self.finish.items():
            if reason not in ("stop", "tool_calls"):
                continue
            try:
                jsonschema.validate(json.loads(self.texts.get(index, "")), req.schema)
            except (ValueError, jsonschema.ValidationError) as exc:
                bad.append(f"{index}: {str(exc)[:120]}")
        return bad


def plain_request(rng: random.Random, model: str) -> MixRequest:
    return MixRequest(
        {
            "model": model,
            "messages": [{"role": "user", "content": LONG if rng.random() < 0.3 else SHORT}],
            "max_tokens": rng.randint(16, 128),
            "temperature": rng.choice([0.0, 0.7]),
            "stream": rng.random() < 0.6,
        }
    )


def chaos_request(rng: random.Random, model: str) -> MixRequest:
    body: dict = {
        "model": model,
        "messages": [
            {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
            {"role": "user", "content": rng.choice(USER_PROMPTS)},
        ],
        "n": rng.randint(1, 3),
        "max_tokens": rng.randint(16, 96),
        "temperature": rng.choice([0.0, 0.8]),
        "stream": rng.random() < 0.5,
    }
    kind = rng.random()
    if kind < 0.3:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        }
        return MixRequest(body, PERSON_SCHEMA)
    if kind < 0.5:
        body["tools"] = [WEATHER_TOOL]
        body["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
        return MixRequest(body, WEATHER_TOOL["function"]["parameters"], tool=True)
    return MixRequest(body)


MIXES: dict[str, Callable[[random.Random, str], MixRequest]] = {
    "plain": plain_request,
    "chaos": chaos_request,
}


def send(url: str, req: MixRequest, timeout_s: float) -> Answer:
    """POST the request to the router at `url` and read the whole answer."""
    try:
        if not req.body.get("stream"):
            resp = httpx.post(f"{url}/v1/chat/completions", json=req.body, timeout=timeout_s)
            if resp.status_code != 200:
                return _error(resp.status_code, resp.json()["error"])
            answer = Answer("completed", 200)
            for choice in resp.json()["choices"]:
                message, index = choice["message"], choice["index"]
                calls = message.get("tool_calls") or []
                answer.texts[index] = (
                    calls[0]["function"]["arguments"] if calls else (message.get("content") or "")
                )
                answer.finish[index] = choice["finish_reason"]
            return answer
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json=req.body, timeout=timeout_s
        ) as resp:
            if resp.status_code != 200:
                resp.read()
                return _error(resp.status_code, resp.json()["error"])
            return _read_stream(resp)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return Answer("lost", detail=f"{type(exc).__name__}: {exc}")


def _error(status: int, error: dict) -> Answer:
    return Answer(
        "failed",
        status,
        error.get("message", ""),
        error.get("type") or "",
        error.get("code") or "",
    )


def _read_stream(resp: httpx.Response) -> Answer:
    answer, done = Answer("completed", 200), False
    for line in resp.iter_lines():
        if line == "data: [DONE]":
            done = True
            continue
        if not line.startswith("data: "):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            failed = _error(200, chunk["error"])
            failed.tokens = answer.tokens
            answer = failed
            continue
        for choice in chunk.get("choices", []):
            index, delta = choice["index"], choice.get("delta") or {}
            piece = delta.get("content") or "".join(
                (c.get("function") or {}).get("arguments") or ""
                for c in delta.get("tool_calls") or []
            )
            if piece:
                answer.tokens += 1
                answer.texts[index] = answer.texts.get(index, "") + piece
            if choice.get("finish_reason"):
                answer.finish[index] = choice["finish_reason"]
    if not done:
        return Answer("lost", detail="stream ended without [DONE]")
    return answer
