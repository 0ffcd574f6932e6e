"""MTP drafts through the served stack with the official `openai` client, on the demo (its
trained MTP layer): a stack with `TPLA_SPECULATIVE=mtp` and its prefill worker a group of two
ranks (`TPLA_PREFILL_TP=2`) answers greedy, seeded and n = 2 requests token for token as a
stack without drafts and a one-process prefill worker; drafts are fed and kept (the prefill
ranks ship the MTP layer's prompt latents, the leader the last hidden state)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_speculative import answers, finished_record
from tests.stack import start_stack
from tools.local_stack import LocalStack

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"
MESSAGES = [{"role": "user", "content": "Tell me about the river that runs by the old town."}]
REQUESTS = [
    {"temperature": 0, "max_tokens": 40},
    {"temperature": 0.8, "seed": 5, "max_tokens": 30},
    {"temperature": 0.8, "top_p": 0.9, "seed": 9, "max_tokens": 20, "n": 2},
]


@pytest.fixture(scope="module")
def stacks() -> Iterator[dict[str, LocalStack]]:
    started: dict[str, LocalStack] = {}
    try:
        for method, prefill_tp in (("none", "1"), ("mtp", "2")):
            started[method] = start_stack(
                DEMO, "grpc", SPECULATIVE=method, SPEC_TOKENS="2", PREFILL_TP=prefill_tp
            )
        yield started
    finally:
        for s in started.values():
            s.stop()


def test_mtp_drafts_change_no_answer(stacks: dict[str, LocalStack]) -> None:
    plain = answers(stacks["none"], MESSAGES, REQUESTS)
    drafted = answers(stacks["mtp"], MESSAGES, REQUESTS)
    assert [texts for texts, _ in drafted] == [texts for texts, _ in plain]
    records = [finished_record(stacks["mtp"], rid) for _, rid in drafted]
    fed = sum(int(r["spec_draft_tokens"]) for r in records)
    kept = sum(int(r["spec_accepted_tokens"]) for r in records)
    assert fed > kept > 0
