"""Locust workloads for the tpla-serve router's OpenAI API.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 [ShortChatUser ...]

(or `make loadtest`, which runs loadtest/run.py). User classes:
  ShortChatUser   short chat turns, streamed;
  LongPromptUser  long prompts (prefill-heavy), streamed;
  MixedUser       both, plus non-streamed chat and streamed /v1/completions.

For a streamed request Locust's own response time ends when the headers arrive, which says
little about an LLM server. Every stream is therefore read to `data: [DONE]` and reports
three more entries through `events.request` (request type "SSE"):
  "<name> TTFT"  request sent -> first chunk with generated text;
  "<name> ITL"   gap between consecutive chunks with text (one entry per gap);
  "<name> E2E"   request sent -> [DONE]; its "size" is the completion token count.
A stream without [DONE], with an in-band error body, or (with ignore_eos) with fewer
tokens than asked fails its request.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from locust import HttpUser, between, events, task
from locust.env import Environment

DONE = "[DONE]"
TOPICS = (
    "reverse a linked list",
    "parse an ISO 8601 date",
    "merge two sorted lists",
    "count words in a file",
    "check whether a string is a palindrome",
    "flatten a nested list",
    "compute a running median",
    "retry a function with exponential backoff",
)
# Long prompts are built from code, which the demo model (trained on the standard
# library) tokenizes like its training data.
CODE_SNIPPET = (
    "def load_config(path): with open(path) as handle: data = json.load(handle) "
    "for key, value in data.items(): if value is None: raise ValueError(key) "
    "return {key: value for key, value in sorted(data.items())}"
)
CODE_WORDS = tuple(CODE_SNIPPET.split(" "))


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any) -> None:
    parser.add_argument("--model-name", default="tpla-demo", help="the `model` field sent")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request")
    parser.add_argument(
        "--long-prompt-words", type=int, default=400, help="words in LongPromptUser prompts"
    )
    parser.add_argument(
        "--api-key", default="", env_var="TPLA_LOADTEST_API_KEY", help="Bearer key, if any"
    )
    parser.add_argument(
        "--respect-eos",
        action="store_true",
        help="let generation stop at EOS (default: ignore_eos, for a fixed output length)",
    )


class StreamError(Exception):
    """The SSE stream broke the wire format or reported an error in-band."""


@dataclass
class StreamResult:
    """What one streamed response carried, with arrival times relative to the request."""

    text_times: list[float] = field(default_factory=list)  # seconds, chunks with text
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None  # from the usage chunk
    done_at: float | None = None


def sse_payloads(lines: Iterable[bytes | str]) -> Iterator[str]:
    """The `data:` payloads of an SSE stream, one per event (multi-line data joined)."""
    data: list[str] = []
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        line = line.rstrip("\r")
        if not line:  # a blank line dispatches the event
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):  # comment / keep-alive
            continue
        key, _, value = line.partition(":")
        if key == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def read_stream(lines: Iterable[bytes | str], start: float) -> StreamResult:
    """Read chat or completion chunks up to `data: [DONE]`; raise StreamError otherwise."""
    result = StreamResult()
    for payload in sse_payloads(lines):
        now = time.perf_counter() - start
        if payload == DONE:
            result.done_at = now
            return result
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError as exc:
            raise StreamError(f"non-JSON data line: {payload[:120]!r}") from exc
        if "error" in chunk:
            raise StreamError(f"error in stream: {chunk['error'].get('message', chunk)}")
        if chunk.get("usage"):
            result.completion_tokens = chunk["usage"].get("completion_tokens")
        for choice in chunk.get("choices", []):
            text = choice.get("delta", {}).get("content") or choice.get("text") or ""
            if text:
                result.text_times.append(now)
                result.text += text
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
    raise StreamError("stream ended without data: [DONE]")


def _fire(env: Environment, name: str, seconds: float, size: int = 0) -> None:
    env.events.request.fire(
        request_type="SSE",
        name=name,
        response_time=seconds * 1000.0,
        response_length=size,
        exception=None,
        context={},
    )


class TplaUser(HttpUser):
    """Shared request helpers; concrete users below pick the workload."""

    abstract = True
    wait_time = between(0.5, 2.0)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.model: str = getattr(opts, "model_name", "tpla-demo")
        self.max_tokens: int = getattr(opts, "max_tokens", 64)
        self.long_words: int = getattr(opts, "long_prompt_words", 400)
        self.ignore_eos: bool = not getattr(opts, "respect_eos", False)
        key = getattr(opts, "api_key", "")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.turn = 0

    # -- prompts -------------------------------------------------------------------------

    def short_messages(self) -> list[dict[str, str]]:
        self.turn += 1
        topic = TOPICS[self.turn % len(TOPICS)]
        return [{"role": "user", "content": f"Write a Python function to {topic}."}]

    def long_messages(self) -> list[dict[str, str]]:
        self.turn += 1
        words = [CODE_WORDS[(self.turn + i) % len(CODE_WORDS)] for i in range(self.long_words)]
        content = "Explain what this code does:\n" + " ".join(words)
        return [{"role": "user", "content": content}]

    # -- requests ------------------------------------------------------------------------

    def _body(self, stream: bool, **fields: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": 0.7,
            "ignore_eos": self.ignore_eos,
            "stream": stream,
            **fields,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def stream(self, path: str, name: str, body: dict[str, Any]) -> None:
        """POST a streamed request, validate the SSE stream, report TTFT / ITL / E2E."""
        start = time.perf_counter()
        with self.client.post(
            path, json=body, headers=self.headers, stream=True, catch_response=True, name=name
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            try:
                result = read_stream(resp.iter_lines(), start)
            except (StreamError, OSError) as exc:  # OSError: the connection broke mid-stream
                resp.failure(str(exc))
                return
            problem = self._check(result)
            if problem:
                resp.failure(problem)
                return
            resp.success()
        times = result.text_times
        if times:
            _fire(self.environment, f"{name} TTFT", times[0])
        for before, after in itertools.pairwise(times):
            _fire(self.environment, f"{name} ITL", after - before)
        assert result.done_at is not None  # read_stream returns only after [DONE]
        _fire(self.environment, f"{name} E2E", result.done_at, result.completion_tokens or 0)

    def _check(self, result: StreamResult) -> str | None:
        if result.finish_reason is None:
            return "stream finished without a finish_reason"
        if self.ignore_eos and result.completion_tokens not in (None, self.max_tokens):
            return f"{result.completion_tokens} tokens, asked for {self.max_tokens}"
        return None

    def chat_stream(self, messages: list[dict[str, str]], name: str) -> None:
        self.stream("/v1/chat/completions", name, self._body(True, messages=messages))

    def chat_full(self, messages: list[dict[str, str]], name: str) -> None:
        body = self._body(False, messages=messages)
        with self.client.post(
            "/v1/chat/completions", json=body, headers=self.headers, catch_response=True, name=name
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            try:
                choice = resp.json()["choices"][0]
                ok = choice["finish_reason"] is not None and "content" in choice["message"]
            except (ValueError, KeyError, IndexError, TypeError):
                ok = False
            if ok:
                resp.success()
            else:
                resp.failure(f"not a chat completion: {resp.text[:200]}")


class ShortChatUser(TplaUser):
    """Interactive chat: short prompts, streamed answers (decode-heavy)."""

    @task
    def short_chat(self) -> None:
        self.chat_stream(self.short_messages(), "chat short")


class LongPromptUser(TplaUser):
    """Long prompts, short answers: prefill and KV transfer dominate."""

    @task
    def long_prompt(self) -> None:
        self.chat_stream(self.long_messages(), "chat long")


class MixedUser(TplaUser):
    """A mix of the API: mostly short streamed chat, some long prompts and other shapes."""

    @task(6)
    def short_chat(self) -> None:
        self.chat_stream(self.short_messages(), "chat short")

    @task(2)
    def long_prompt(self) -> None:
        self.chat_stream(self.long_messages(), "chat long")

    @task(1)
    def short_chat_full(self) -> None:
        self.chat_full(self.short_messages(), "chat short (non-stream)")

    @task(1)
    def completion_stream(self) -> None:
        prompt = f"def {TOPICS[self.turn % len(TOPICS)].split()[0]}_"
        self.turn += 1
        self.stream("/v1/completions", "completion", self._body(True, prompt=prompt))
