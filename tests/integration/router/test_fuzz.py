"""Schemathesis against the real router: its own /openapi.json, a live uvicorn on 127.0.0.1,
real Redis and the scripted gRPC workers of conftest.py.

Every operation gets a fixed number of schema-valid and schema-violating examples from a
derandomized Hypothesis run (the same cases every time), and every response must be non-5xx
and conform to the schema: documented status, content type and body. The stack runs in a
thread with its own event loop because schemathesis' calls are synchronous.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup

from common.text.tokenizer import Tokenizer
from tests.router_rig import Script, run_stack

EXAMPLES_PER_OPERATION = 40  # per operation and generation mode: ~15 s in all
SERVED_MODEL = "tpla-test"  # conftest's run_stack
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.fixture
def live_router(model_dir: Path, redis_url: str, tokenizer: Tokenizer) -> Iterator[str]:
    """The router stack served from a background event loop; yields its base URL."""
    script = Script([*tokenizer.encode("hello world"), min(tokenizer.eos_token_ids)])
    started, base = threading.Event(), []
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    failure: list[BaseException] = []

    async def serve() -> None:
        # A high admission limit: the fuzzer is one client, 429s would only hide behaviour.
        async with run_stack(model_dir, redis_url, script, max_inflight=1000) as stack:
            base.append(stack.base_url)
            started.set()
            while not stop.is_set():  # heartbeats: the fuzz run outlives the records' TTL
                for record in stack.registry.list():
                    stack.registry.publish(record)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=1.0)

    def run() -> None:
        try:
            loop.run_until_complete(serve())
        except BaseException as exc:  # reported by the fixture, not lost in the thread
            failure.append(exc)
        finally:
            started.set()
            loop.close()

    thread = threading.Thread(target=run, name="router-stack", daemon=True)
    thread.start()
    try:
        assert started.wait(30) and base, f"router stack did not start: {failure}"
        yield base[0]
    finally:
        if not loop.is_closed():
            loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=30)
        assert not thread.is_alive(), "router stack did not shut down"
    assert not failure, failure


def _served_model(case: schemathesis.Case) -> schemathesis.Case:
    # Random model names all end in 404 model_not_found; name the served model in valid
    # bodies so the fuzzer reaches the pipeline and the workers.
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = SERVED_MODEL
    return case


def _fuzz(op: schemathesis.APIOperation, mode: GenerationMode, base: str) -> tuple[int, list[str]]:
    """Run one operation in one mode; returns (cases sent, failure reports)."""
    failures: list[str] = []
    calls = 0
    strategy = op.as_strategy(generation_mode=mode)
    if mode is GenerationMode.POSITIVE:
        strategy = strategy.map(_served_model)

    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        derandomize=True,  # a fixed seed: the same cases on every run
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: report, don't dwell
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case: schemathesis.Case) -> None:
        nonlocal calls
        calls += 1
        try:
            case.call_and_validate(base_url=base, checks=CHECKS, timeout=10)
        except (AssertionError, FailureGroup) as exc:  # collect: one run reports them all
            failures.append(f"{op.label} [{mode}]: {exc}\n{case.as_curl_command()}")

    try:
        run()
    except Unsatisfiable:
        # No input can violate the schema (no parameters, or one free-form path string).
        assert mode is GenerationMode.NEGATIVE, op.label
    return calls, failures


def test_schemathesis_finds_no_5xx_or_schema_mismatch(live_router: str) -> None:
    schema = schemathesis.openapi.from_url(f"{live_router}/openapi.json")
    operations = {result.ok().label: result.ok() for result in schema.get_all_operations()}
    assert set(operations) >= {
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "GET /v1/models",
        "GET /admin/requests/{request_id}",
    }
    failures: list[str] = []
    calls: dict[tuple[str, GenerationMode], int] = {}
    for label, op in operations.items():
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            calls[label, mode], found = _fuzz(op, mode, live_router)
            failures += found
    assert all(calls[label, GenerationMode.POSITIVE] for label in operations), calls
    for label in ("POST /v1/chat/completions", "POST /v1/completions"):
        assert calls[label, GenerationMode.NEGATIVE] >= EXAMPLES_PER_OPERATION // 2, calls
    assert not failures, f"{len(failures)} failures:\n\n" + "\n\n".join(failures[:10])
