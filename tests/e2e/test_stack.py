"""End to end through the HTTP API with the official `openai` client, real processes."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.text.chat_template import ChatMessage
from common.text.tokenizer import Tokenizer
from tests.cli import tpla_json
from tests.stack import MODEL_NAME, start_stack
from tools.local_stack import LocalStack

MESSAGES = [{"role": "user", "content": "hello world, the quick brown fox"}]


def _client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _reference_text(
    stack: LocalStack, max_tokens: int, messages: list[dict[str, str]] = MESSAGES
) -> tuple[str, list[int]]:
    """`tpla generate` greedy on the same chat prompt, same mode (TPLA tp=2, r=2), without
    any prefix cache."""
    tok = Tokenizer.from_dir(stack.model_dir)
    ids = tok.encode_chat([ChatMessage(m["role"], m["content"]) for m in messages])
    ids_arg = ",".join(map(str, ids))
    out = tpla_json(
        "generate", "--model", str(stack.model_dir), "--prompt-ids", ids_arg,
        "--max-tokens", str(max_tokens), "--tp", "2", "--latent-groups", "2",
        "--method", "identity", "--json", timeout=300,
    )  # fmt: skip
    return out["text"], out["token_ids"]


def _chat(stack: LocalStack, messages: list[dict[str, str]] = MESSAGES, **kw: object):
    return _client(stack).chat.completions.create(
        model=MODEL_NAME, messages=messages, temperature=0, **kw
    )


SYSTEM = {
    "role": "system",
    "content": "you are a careful assistant. " * 12 + "answer the quick brown fox questions.",
}


def _conversation_reuses_cached_prefixes(stack: LocalStack, tag: str) -> None:
    """Two turns of one conversation, the first sent twice: the repeat and the second turn
    reuse the cached prefix (usage says how much) and answer exactly as `tpla generate`,
    which has no cache; afterwards no block is held and the prefixes stay cached."""
    first = [SYSTEM, {"role": "user", "content": f"{tag}: hello world, the quick brown fox"}]
    a = _chat(stack, first, max_tokens=6)
    again = _chat(stack, first, max_tokens=6)
    assert again.choices[0].message.content == a.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= 16 * (a.usage.prompt_tokens // 16)
    second = [
        *first,
        {"role": "assistant", "content": a.choices[0].message.content},
        {"role": "user", "content": "and then?"},
    ]
    turn = _chat(stack, second, max_tokens=6)
    assert turn.usage.prompt_tokens_details.cached_tokens >= 16
    assert turn.choices[0].message.content == _reference_text(stack, 6, second)[0]
    leader = next(
        w
        for w in httpx.get(f"{stack.url}/admin/workers", timeout=10).json()
        if w["role"] == "decode" and w["rank"] == 0
    )
    assert leader["kv_blocks_cached"] > 0
    deadline = time.monotonic() + 10
    while leader["kv_blocks_used"] and time.monotonic() < deadline:  # the heartbeat may lag
        time.sleep(0.5)
        leader = next(
            w
            for w in httpx.get(f"{stack.url}/admin/workers", timeout=10).json()
            if w["role"] == "decode" and w["rank"] == 0
        )
    assert leader["kv_blocks_used"] == 0


def test_non_streaming_greedy_equals_tpla_generate(stack: LocalStack) -> None:
    resp = _chat(stack, max_tokens=12)
    expected_text, expected_ids = _reference_text(stack, 12)
    assert resp.choices[0].message.content == expected_text
    assert resp.usage.completion_tokens == len(expected_ids)
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_streaming_matches_non_streaming_and_reports_usage(stack: LocalStack) -> None:
    full = _chat(stack, max_tokens=10).choices[0].message.content
    chunks = list(_chat(stack, max_tokens=10, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_sixteen_concurrent_streams_complete(stack: LocalStack) -> None:
    def one(i: int) -> str:
        stream = _client(stack).chat.completions.create(
            model=MODEL_NAME,
            stream=True,
            max_tokens=8 + i % 5,
            temperature=0.7,
            seed=i,
            messages=[{"role": "user", "content": f"request number {i}"}],
        )
        reasons = [c.choices[0].finish_reason for c in stream if c.choices]
        return reasons[-1]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        reasons = list(pool.map(one, range(16)))
    assert all(r in ("stop", "length") for r in reasons)


def test_prefix_cache_reuse_keeps_greedy_output(stack: LocalStack) -> None:
    _conversation_reuses_cached_prefixes(stack, "grpc")


def test_redis_record_walks_the_state_machine(stack: LocalStack) -> None:
    resp = _chat(stack, max_tokens=4)
    record = httpx.get(f"{stack.url}/admin/requests/{resp.id}", timeout=10).json()
    states = [h["state"] for h in record["history"]]
    assert states == ["QUEUED", "PREFILLING", "TRANSFERRING", "DECODING", "FINISHED"]
    # From the end of the prompt's last chunk to the last rank's ack (the prompt's chunks
    # shipped as they were computed).
    assert float(record["exposed_transfer_seconds"]) > 0


def test_metrics_count_ttft(stack: LocalStack) -> None:
    def ttft_count() -> float:
        text = httpx.get(f"{stack.url}/metrics", timeout=10).text
        return sum(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "tpla:time_to_first_token_seconds_count"
        )

    before = ttft_count()
    for _ in range(3):
        _chat(stack, max_tokens=3)
    assert ttft_count() == before + 3


def test_bad_requests_get_openai_errors(stack: LocalStack) -> None:
    client = _client(stack)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=100_000)


def test_workers_listed_and_sigint_stops_everything(tiny_model) -> None:
    """Both transports serve; after SIGINT no process of the stack remains."""
    s = start_stack(tiny_model, "torch")
    try:
        expected_text, _ = _reference_text(s, 8)
        assert _chat(s, max_tokens=8).choices[0].message.content == expected_text
        _conversation_reuses_cached_prefixes(s, "torch")
        workers = httpx.get(f"{s.url}/admin/workers", timeout=10).json()
        roles = sorted((w["role"], w["rank"]) for w in workers)
        assert roles == [("decode", 0), ("decode", 1), ("prefill", 0)]
        pids = [w["pid"] for w in workers]
    finally:
        s.stop()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        time.sleep(0.2)
    assert not alive, f"processes left after SIGINT: {alive}"


def _alive(pid: int) -> bool:
    """Running (a zombie awaiting its reaper counts as gone: it holds no resources)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
