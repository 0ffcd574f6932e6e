"""/openapi.json as the router really behaves: OpenAI error bodies on every route (never
FastAPI's 422), and the JSON-or-SSE success bodies the routes build by hand. Schemathesis
(tests/integration/router/test_fuzz.py) checks responses against this document."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from services.router.edge import MAX_BODY_BYTES
from services.router.response_schemas import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    ErrorBody,
)


def _ref(model: type[BaseModel]) -> dict[str, Any]:
    return {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}


def _sse(chunk: type[BaseModel]) -> dict[str, Any]:
    """One SSE event: a JSON chunk, an in-band error body, or the closing [DONE]."""
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [_ref(chunk)["schema"], _ref(ErrorBody)["schema"]]},
    }
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}},
    }
    return {"text/event-stream": {"schema": event}}


_READY = {
    "type": "object",
    "properties": {
        "status": {"type": "string"},
        "reason": {"type": "string"},
        # Ready without a prefill worker to use: the decode groups prefill every prompt.
        "degraded": {"type": "string"},
    },
    "required": ["status"],
}

# The routes return raw Responses (JSON or SSE, chosen per request), which FastAPI cannot
# describe; /openapi.json takes their success bodies from here.
DOCUMENTED_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionResponse,
    ChatCompletionChunk,
    CompletionResponse,
    ErrorBody,
)
SUCCESS_DOCS: dict[tuple[str, str], dict[str, dict[str, Any]]] = {
    ("post", "/v1/chat/completions"): {
        "200": {
            "description": "the completion, or SSE chunks when stream is true",
            "content": {
                "application/json": _ref(ChatCompletionResponse),
                **_sse(ChatCompletionChunk),
            },
        }
    },
    ("post", "/v1/completions"): {
        "200": {
            "description": "the completion, or SSE chunks when stream is true",
            "content": {
                "application/json": _ref(CompletionResponse),
                **_sse(CompletionResponse),
            },
        }
    },
    ("get", "/metrics"): {
        "200": {
            "description": "Prometheus text exposition",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    },
    ("get", "/ready"): {
        "200": {
            "description": "ready (with `degraded`: no prefill worker can be used, the decode "
            "groups prefill every prompt)",
            "content": {"application/json": {"schema": _READY}},
        },
        "503": {
            "description": "no healthy decode group",
            "content": {"application/json": {"schema": _READY}},
        },
    },
}


_ERROR_DOCS = {
    "400": "invalid request (bad JSON, parameter, context length); never 422",
    "401": "missing or invalid API key (when TPLA_API_KEYS is set)",
    "404": "unknown model (code model_not_found) or record",
    "413": f"request body larger than {MAX_BODY_BYTES} bytes",
    "415": "Content-Type is not application/json",
    "429": "admission limit reached; retry after Retry-After seconds",
    "500": "internal error",
    "503": "no healthy worker, or a worker failed",
    "504": "the request timed out",
}


def _errors_for(path: str, op: dict[str, Any]) -> list[str]:
    statuses = ["500"]
    if path.startswith(("/v1/", "/admin/")):
        statuses += ["401", "503"]  # 503: Redis (records, registry) unreachable
    if "parameters" in op or "requestBody" in op:
        statuses += ["400", "404"]
    if "requestBody" in op:  # the generation routes
        statuses += ["413", "415", "429", "503", "504"]
    return statuses


def document_responses(app: FastAPI) -> None:
    """Make /openapi.json describe what the routes and the handlers above really send: OpenAI
    error bodies (never FastAPI's 422) and the success bodies in SUCCESS_DOCS."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()  # FastAPI caches this very dict in app.openapi_schema
        _, defs = models_json_schema(
            [(m, "serialization") for m in DOCUMENTED_MODELS],
            ref_template="#/components/schemas/{model}",
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(defs.get("$defs", {}))
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
        for path, ops in schema.get("paths", {}).items():
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                responses.update(SUCCESS_DOCS.get((method, path), {}))
                for status in _errors_for(path, op):
                    responses.setdefault(
                        status, {"description": _ERROR_DOCS[status], "content": error}
                    )
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
