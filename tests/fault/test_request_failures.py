"""A request of death on the real stack: a structured output whose grammar fails inside the
decode group (an ambiguous grammar past the stack's llguidance item limit, so its parser stops
some 20 tokens in) ends that request alone, with its error; no group is quarantined, nothing
migrates, and every other request (the mix real clients send) is answered.

One `tpla serve` stack with two decode groups and two prefill workers, as in production.
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.mix import Answer, MixRequest, chaos_request, send
from tests.stack import MODEL_NAME, start_stack
from tests.tiny import save_tiny_chat_model
from tools.local_stack import LocalStack

CLIENT_TIMEOUT_S = 60.0
# Its parser's items grow with every token read: past 100 a mask (the limit the stack is
# given) after about 23 one-letter tokens, well after the prefill's first token.
POISON_GRAMMAR = 'start: s\ns: s s | "a" | "b"\n'
POISON_LENGTH = 40


def poison(stream: bool) -> MixRequest:
    return MixRequest(
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "write a and b"}],
            "structured_outputs": {"grammar": POISON_GRAMMAR},
            "max_tokens": POISON_LENGTH,
            "min_tokens": POISON_LENGTH,  # EOS held off: the grammar must go on
            "temperature": 0.0,
            "stream": stream,
        }
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    model = save_tiny_chat_model(tmp_path_factory.mktemp("death-model"), std=0.08)
    s = start_stack(
        model,
        "grpc",
        DECODE_GROUPS="2",
        PREFILL_WORKERS="2",
        KV_BUDGET_MB="16",
        WORKER_TTL_S="3",
        GRAMMAR_STEP_MAX_ITEMS="100",
    )
    yield s
    s.stop()


def assert_poisoned(answer: Answer, stream: bool) -> None:
    assert answer.outcome == "failed", answer
    assert answer.status == (200 if stream else 400), answer
    assert answer.error_type == "invalid_request_error" and answer.error_code == "request_failed"
    assert answer.detail.startswith("structured output: the grammar cannot go on"), answer
    if stream:  # it failed in the decode group, tokens after its first
        assert answer.tokens > 5, answer


def nobody_blamed(stack: LocalStack) -> None:
    """No group quarantined, no request moved, every worker healthy."""
    assert {w["quarantined"] for w in stack.workers()} == {None}
    metrics = httpx.get(f"{stack.url}/metrics", timeout=10).text
    samples = [s for f in text_string_to_metric_families(metrics) for s in f.samples]
    assert sum(s.value for s in samples if s.name == "tpla:request_migrations_total") == 0
    healthy = [s for s in samples if s.name == "tpla:worker_healthy"]
    assert healthy and all(s.value == 1 and s.labels["reason"] == "" for s in healthy)


def test_a_failing_grammar_ends_its_request_alone(stack: LocalStack) -> None:
    rng = random.Random(0)
    others = [chaos_request(rng, MODEL_NAME) for _ in range(50)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(send, stack.url, r, CLIENT_TIMEOUT_S) for r in others]
        poisoned = [send(stack.url, poison(stream), CLIENT_TIMEOUT_S) for stream in (True, False)]
        answers = [f.result() for f in futures]
    for stream, answer in zip((True, False), poisoned, strict=True):
        assert_poisoned(answer, stream)
    for req, answer in zip(others, answers, strict=True):
        assert answer.outcome == "completed", (req.body, answer)
        assert not answer.invalid(req), (req.body, answer)
    nobody_blamed(stack)


def test_the_same_failure_twenty_times_takes_nobody_down(stack: LocalStack) -> None:
    stop, answers = threading.Event(), []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            answers.append(send(stack.url, chaos_request(rng, MODEL_NAME), CLIENT_TIMEOUT_S))

    threads = [threading.Thread(target=client, args=(seed,)) for seed in (1, 2, 3)]
    for t in threads:
        t.start()
    try:
        for k in range(20):
            assert_poisoned(send(stack.url, poison(k % 2 == 0), CLIENT_TIMEOUT_S), k % 2 == 0)
    finally:
        stop.set()
        for t in threads:
            t.join(CLIENT_TIMEOUT_S)
    assert answers and all(a.outcome == "completed" for a in answers), [
        a for a in answers if a.outcome != "completed"
    ]
    nobody_blamed(stack)


def test_the_client_mix_is_answered_and_structured_answers_validate(stack: LocalStack) -> None:
    """The chaos mix (loadtest/mix.py) for 20 s from 4 clients: no 503 (no error at all),
    every structured answer that finished with "stop" validates. `loadtest/soak.py --mix
    chaos --kill-every 0` runs it for minutes against the demo model."""
    deadline = time.monotonic() + 20.0

    def client(seed: int) -> list[tuple[MixRequest, Answer]]:
        rng, out = random.Random(seed), []
        while time.monotonic() < deadline:
            req = chaos_request(rng, MODEL_NAME)
            out.append((req, send(stack.url, req, CLIENT_TIMEOUT_S)))
        return out

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = [r for f in [pool.submit(client, s) for s in range(10, 14)] for r in f.result()]
    assert len(results) > 20
    for req, answer in results:
        assert answer.outcome == "completed", (req.body, answer)
        assert not answer.invalid(req), (req.body, answer)
    nobody_blamed(stack)
