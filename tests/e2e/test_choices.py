"""n > 1 choices and /v1/completions (echo, logprobs, batches of prompts) end to end with the
official `openai` client, on a real stack in each decode layout (TPLA, MLA-TP, SP)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.stack import MODEL_NAME, start_stack
from tools.local_stack import LocalStack

MESSAGES = [{"role": "user", "content": "hello world, the quick brown fox"}]
# Small blocks and SP chunks: the prompts span several chunks and end inside a block, so
# every fork copies a partly filled last block.
LAYOUTS = {
    "tpla": {},
    "mla-tp": {"PARALLEL": "mla-tp"},
    "sp": {"PARALLEL": "sp", "CHUNK_SIZE": "8"},
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_stack(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[LocalStack]:
    s = start_stack(tiny_model, "grpc", BLOCK_SIZE="4", **LAYOUTS[request.param])
    yield s
    s.stop()


def _client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(stack: LocalStack, **kw: object):
    return _client(stack).chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **kw)


def _wait_blocks_free(stack: LocalStack, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    used = None
    while time.monotonic() < deadline:
        used = [w["kv_blocks_used"] for w in stack.workers() if w["role"] == "decode"]
        if used and not any(used):
            return
        time.sleep(0.2)
    raise AssertionError(f"KV blocks still used: {used}")


def test_n_choices_in_every_layout(layout_stack: LocalStack) -> None:
    stack = layout_stack
    forced = {"extra_body": {"ignore_eos": True}}
    # Greedy: every choice is the n = 1 answer; usage counts the prompt once.
    one = _chat(stack, temperature=0, max_tokens=6, **forced)
    two = _chat(stack, temperature=0, max_tokens=6, n=2, **forced)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.message.content for c in two.choices] == [one.choices[0].message.content] * 2
    assert two.usage.prompt_tokens == one.usage.prompt_tokens
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens == 12

    # Seeded sampling: reproducible per choice; choice 0 is the n = 1 request's answer.
    seeded = {"temperature": 1.0, "seed": 11, "max_tokens": 8}
    three = _chat(stack, n=3, **seeded)
    again = _chat(stack, n=3, **seeded)
    texts = [c.message.content for c in three.choices]
    assert texts == [c.message.content for c in again.choices]
    assert texts[0] == _chat(stack, **seeded).choices[0].message.content
    assert len(set(texts)) > 1
    assert all(c.finish_reason in ("stop", "length") for c in three.choices)

    # Streaming: every chunk names its choice; the same texts as without streaming.
    chunks = list(_chat(stack, n=3, stream=True, stream_options={"include_usage": True}, **seeded))
    streamed = ["", "", ""]
    reasons: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    assert streamed == texts and sorted(reasons) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == three.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == one.usage.prompt_tokens
    _wait_blocks_free(stack)


def test_closing_an_n_stream_frees_every_fork(layout_stack: LocalStack) -> None:
    stream = _chat(
        layout_stack,
        n=3,
        stream=True,
        max_tokens=200,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    seen, request_id = 0, ""
    for chunk in stream:
        request_id = chunk.id
        seen += sum(1 for c in chunk.choices if c.delta.content)
        if seen >= 6:
            break
    stream.close()
    record = {}
    for _ in range(50):
        record = httpx.get(f"{layout_stack.url}/admin/requests/{request_id}", timeout=10).json()
        if record["state"] != "DECODING":
            break
        time.sleep(0.1)
    assert record["state"] == "ABORTED"  # the router aborted it, not a finish
    time.sleep(1.2)  # past the heartbeats that reported the group before the abort
    _wait_blocks_free(layout_stack)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_n_choices_each_follow_a_json_schema(layout_stack: LocalStack) -> None:
    """Each fork carries its own grammar state (forked at its first token): every choice of
    a sampled n = 3 request is a complete JSON document valid for the schema."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    resp = _chat(layout_stack, n=3, temperature=1.0, seed=4, max_tokens=200, response_format=fmt)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for c in resp.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), PERSON)
    assert len({c.message.content for c in resp.choices}) > 1  # forked, not copied
    _wait_blocks_free(layout_stack)


def test_n_choices_with_a_presence_penalty_and_a_seed(layout_stack: LocalStack) -> None:
    """Each fork has its own penalty counts (copied at its first token, which went through
    the same processing at the prefill worker): greedy choices all equal the n = 1 answer
    under the penalty, and seeded choices reproduce, choice 0 being the n = 1 request's."""
    base = {"max_tokens": 12, "presence_penalty": 1.5, "extra_body": {"ignore_eos": True}}
    greedy = {**base, "temperature": 0}
    one = _chat(layout_stack, **greedy).choices[0].message.content
    plain = _chat(layout_stack, temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    assert one != plain.choices[0].message.content  # the penalty is applied
    two = _chat(layout_stack, n=2, **greedy)
    assert [c.message.content for c in two.choices] == [one, one]
    seeded = {**base, "temperature": 1.0, "seed": 21}
    texts = [c.message.content for c in _chat(layout_stack, n=3, **seeded).choices]
    assert texts == [c.message.content for c in _chat(layout_stack, n=3, **seeded).choices]
    assert texts[0] == _chat(layout_stack, **seeded).choices[0].message.content
    assert len(set(texts)) > 1
    _wait_blocks_free(layout_stack)


def _complete(stack: LocalStack, **kw: object):
    return _client(stack).completions.create(model=MODEL_NAME, **kw)


def test_completions_echo_logprobs_and_batches(layout_stack: LocalStack) -> None:
    stack = layout_stack
    greedy = {"temperature": 0, "max_tokens": 5, "extra_body": {"ignore_eos": True}}
    prompts = ["hello world", "the quick brown fox"]
    plain = [_complete(stack, prompt=p, **greedy) for p in prompts]

    # echo: the prompt, then the same completion.
    echoed = _complete(stack, prompt=prompts[0], echo=True, **greedy)
    assert echoed.choices[0].text == prompts[0] + plain[0].choices[0].text

    # echo + logprobs: one entry per prompt token (the first null) then per completion token.
    scored = _complete(stack, prompt=prompts[0], echo=True, logprobs=2, **greedy)
    lp = scored.choices[0].logprobs
    prompt_len, completion_len = scored.usage.prompt_tokens, scored.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == prompt_len + completion_len
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[prompt_len] == len(prompts[0])  # completion after the echoed prompt
    # A prompt position's alternatives are the model's: the last prompt token's top 3 are
    # the top 3 of the first token sampled after the prompt without it.
    ids = _tokenize(stack, prompts[1])
    echo = _complete(stack, prompt=ids, echo=True, logprobs=3, **greedy)
    shorter = _complete(stack, prompt=ids[:-1], logprobs=3, **greedy)
    echoed_top = echo.choices[0].logprobs.top_logprobs[len(ids) - 1]
    sampled_top = shorter.choices[0].logprobs.top_logprobs[0]
    assert echoed_top.keys() == sampled_top.keys()
    for token, value in sampled_top.items():
        assert echoed_top[token] == pytest.approx(value, abs=1e-4)

    # max_tokens 0 with echo scores the prompt alone: the same logprobs, nothing generated.
    scored_only = _complete(stack, prompt=ids, echo=True, logprobs=3, max_tokens=0)
    only = scored_only.choices[0].logprobs
    assert scored_only.usage.completion_tokens == 0 and len(only.tokens) == len(ids)
    assert only.top_logprobs[len(ids) - 1].keys() == echoed_top.keys()

    # A batch of prompts, n = 2: choices prompt-major; usage sums the prompts.
    batch = _complete(stack, prompt=prompts, n=2, **greedy)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    expected = [plain[k].choices[0].text for k in (0, 0, 1, 1)]
    assert [c.text for c in batch.choices] == expected
    assert batch.usage.prompt_tokens == sum(p.usage.prompt_tokens for p in plain)
    by_ids = _complete(stack, prompt=[_tokenize(stack, p) for p in prompts], **greedy)
    assert [c.text for c in by_ids.choices] == [expected[0], expected[2]]
    streamed = ["", "", "", ""]
    for chunk in _complete(stack, prompt=prompts, n=2, stream=True, **greedy):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == expected

    for param, value in (("best_of", 2), ("suffix", "!")):
        with pytest.raises(openai.BadRequestError) as err:
            _complete(stack, prompt="x", **{param: value})
        assert err.value.body["param"] == param
    _wait_blocks_free(stack)


def _tokenize(stack: LocalStack, text: str) -> list[int]:
    from common.text.tokenizer import Tokenizer

    return Tokenizer.from_dir(stack.model_dir).encode(text)
