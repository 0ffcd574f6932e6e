"""Speculative decoding through the served stack with the official `openai` client: a stack
with n-gram drafts (`TPLA_SPECULATIVE=ngram`) answers every request token for token as the
stack without them does, greedy, seeded, n = 2, structured and cut by a stop string; drafts
are fed and kept, and the request's record says how many."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.test_sampling_api import SCHEMAS, TOOL_MESSAGES, TOOLS
from tests.stack import MODEL_NAME, start_stack
from tools.local_stack import LocalStack

# The answer of a tiny random model to a prompt that repeats itself tends to repeat too.
REPEATING = [{"role": "user", "content": "the quick brown fox " * 6}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
REQUESTS = [
    {"temperature": 0, "max_tokens": 40},
    {"temperature": 1.0, "seed": 5, "max_tokens": 30},
    {"temperature": 0.8, "top_p": 0.9, "seed": 9, "max_tokens": 20, "n": 2},
    {
        "temperature": 0.7,
        "seed": 2,
        "max_tokens": 200,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    },
]


@pytest.fixture(scope="module")
def speculative(tiny_model: Path) -> Iterator[LocalStack]:
    s = start_stack(tiny_model, "grpc", SPECULATIVE="ngram", SPEC_TOKENS="4")
    yield s
    s.stop()


def answers(
    stack: LocalStack, messages: list[dict], requests: list[dict]
) -> list[tuple[list[str | None], str]]:
    """Each request's choices' texts and its id, through the openai client."""
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    out = []
    for kw in requests:
        resp = client.chat.completions.create(model=MODEL_NAME, messages=messages, **kw)
        out.append(([c.message.content for c in resp.choices], resp.id))
    return out


def finished_record(stack: LocalStack, rid: str) -> dict:
    """The request's Redis record once it says FINISHED."""
    for _ in range(50):  # the record's last transition lands just after the answer
        record = httpx.get(f"{stack.url}/admin/requests/{rid}", timeout=10).json()
        if record.get("state") == "FINISHED":
            return record
        time.sleep(0.1)
    raise AssertionError(f"request {rid} never recorded FINISHED")


def test_drafts_change_no_answer(stack: LocalStack, speculative: LocalStack) -> None:
    plain = answers(stack, REPEATING, REQUESTS)
    drafted = answers(speculative, REPEATING, REQUESTS)
    assert [texts for texts, _ in drafted] == [texts for texts, _ in plain]
    *_, (structured, _) = drafted
    jsonschema.validate(json.loads(structured[0] or ""), SCHEMA)
    records = [finished_record(speculative, rid) for _, rid in drafted]
    fed = sum(int(r["spec_draft_tokens"]) for r in records)
    kept = sum(int(r["spec_accepted_tokens"]) for r in records)
    assert fed > kept > 0
    assert all(r["spec_draft_tokens"] == "0" for r in (finished_record(stack, plain[0][1]),))


def test_a_stop_string_cuts_a_kept_run_where_plain_decoding_does(
    stack: LocalStack, speculative: LocalStack
) -> None:
    [greedy], _ = answers(stack, REPEATING, REQUESTS)[0]
    assert greedy and len(greedy) > 20
    stop = greedy[12:16]  # inside the answer: drafts were kept around it (see above)
    cut = []
    for s in (stack, speculative):
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        kw = {**REQUESTS[0], "stop": [stop]}
        resp = client.chat.completions.create(model=MODEL_NAME, messages=REPEATING, **kw)
        cut.append((resp.choices[0].message.content, resp.choices[0].finish_reason))
    assert cut[0] == cut[1] == (greedy[: greedy.index(stop)], "stop")
    # Its record keeps the drafts of the steps before the cut (their counts ride on the
    # steps' first tokens, not on a last event the cut never lets come).
    record = finished_record(speculative, resp.id)
    assert int(record["spec_draft_tokens"]) >= int(record["spec_accepted_tokens"]) > 0


def test_tool_calls_validate_and_equal_plain_decoding(
    stack: LocalStack, speculative: LocalStack
) -> None:
    """A required tool call, sampled with a seed: its grammar advances through kept drafts
    and rolls back the rest, so the call validates and equals the one without drafts."""
    calls = []
    for s in (stack, speculative):
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        resp = client.chat.completions.create(
            model=MODEL_NAME,
            messages=TOOL_MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0.8,
            seed=3,
            max_tokens=200,
        )
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        [call] = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        calls.append((call.function.name, call.function.arguments))
    assert calls[0] == calls[1]
