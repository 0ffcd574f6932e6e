"""The stack with its prefill worker as a group of two ranks (`TPLA_PREFILL_TP=2`), through
the official openai client: greedy answers equal `tpla generate` (one prefill process, the
same decode) for every decode layout (TPLA r=2 over gRPC, MLA-TP over the torch transport, SP
over gRPC); a prefill rank killed in the middle of a batch fails its worker, not the request
(the decode group prefills it instead), frees no block twice, and the worker exits and is
restarted."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest

from common.text.chat_template import ChatMessage
from common.text.tokenizer import Tokenizer
from tests.cli import tpla_json
from tests.stack import MODEL_NAME, start_stack
from tools.local_stack import LocalStack

FOLLOWER = "services.prefill.group.follower"
# The exact layouts beside the module's TPLA stack: (transport, stack settings, generate flags).
EXACT_LAYOUTS = {
    "mla-tp": ("torch", {"LATENT_GROUPS": "1", "PARALLEL": "mla-tp"}, ["--parallel", "mla-tp"]),
    "sp": (
        "grpc",
        {"LATENT_GROUPS": "1", "PARALLEL": "sp", "CHUNK_SIZE": "8"},
        ["--parallel", "sp", "--chunk-size", "8"],
    ),
}
MESSAGES = [{"role": "user", "content": "def fibonacci(n): the quick brown fox " * 3}]


@pytest.fixture(scope="module")
def stack(tiny_model: Path) -> Iterator[LocalStack]:
    s = start_stack(tiny_model, "grpc", PREFILL_TP="2")
    yield s
    s.stop()


def _generate(model_dir: Path, *flags: str) -> str:
    """`tpla generate`: one process prefills, a tp=2 decode group of the layout `flags` say."""
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode_chat([ChatMessage(m["role"], m["content"]) for m in MESSAGES])
    out = tpla_json(
        "generate", "--model", str(model_dir), "--prompt-ids", ",".join(map(str, ids)),
        "--max-tokens", "8", "--tp", "2", *flags, "--json", timeout=300,
    )  # fmt: skip
    return out["text"]


@pytest.fixture(scope="module")
def reference(stack: LocalStack) -> str:
    """The same TPLA tp=2 r=2 decode group."""
    return _generate(stack.model_dir, "--latent-groups", "2", "--method", "identity")


def _client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(stack: LocalStack) -> str:
    out = _client(stack).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=8
    )
    return out.choices[0].message.content or ""


def _followers(stack: LocalStack) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(stack.proc.pid).children(recursive=True)
        if FOLLOWER in " ".join(p.cmdline())
    ]


def _wait(what: str, done, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_a_prefill_group_answers_as_one_prefill_process(stack: LocalStack, reference: str) -> None:
    [prefill] = [w for w in stack.workers() if w["role"] == "prefill"]
    assert prefill["tp"] == 2 and prefill["healthy"]
    assert len(_followers(stack)) == 1
    assert _chat(stack) == reference
    assert _chat(stack) == reference  # again, over the group's cached prefix


@pytest.mark.parametrize("layout", EXACT_LAYOUTS)
def test_every_decode_layout_answers_as_one_prefill_process(tiny_model: Path, layout: str) -> None:
    transport, settings, flags = EXACT_LAYOUTS[layout]
    s = start_stack(tiny_model, transport, PREFILL_TP="2", **settings)
    try:
        assert _chat(s) == _generate(tiny_model, "--latent-groups", "1", *flags)
    finally:
        s.stop()


def test_a_rank_killed_mid_batch_fails_the_worker_not_the_request(
    stack: LocalStack, reference: str
) -> None:
    """The prefill group's failure ends its batch; the router prefills the prompt on the
    decode group itself (services/router/prefilling.py: another worker, then the group), so
    the request still answers as one prefill process; the worker exits and restarts."""
    [follower] = _followers(stack)
    [old] = [w for w in stack.workers() if w["role"] == "prefill"]
    os.kill(follower.pid, signal.SIGSTOP)  # the next batch waits for it in a collective
    answers: list[str] = []
    errors: list[BaseException] = []

    def request() -> None:
        try:
            answers.append(_chat(stack))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=request)
    thread.start()
    time.sleep(2.0)
    os.kill(follower.pid, signal.SIGKILL)
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert not errors, errors
    assert answers == [reference]
    _wait("the worker exits", lambda: "prefill-0 exited with code 1" in stack.log())
    # Its decode blocks are freed, and the restarted worker (a new group) serves.
    _wait(
        "a new prefill worker",
        lambda: any(
            w["role"] == "prefill" and w["pid"] != old["pid"] and w["healthy"]
            for w in stack.workers()
        ),
        timeout_s=120,
    )
    leader = lambda: next(w for w in stack.workers() if w["role"] == "decode" and w["rank"] == 0)  # noqa: E731
    _wait("the decode blocks freed", lambda: leader()["kv_blocks_used"] == 0)
    assert _chat(stack) == reference
