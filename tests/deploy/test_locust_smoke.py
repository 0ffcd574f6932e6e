"""A 20-second Locust smoke run through `loadtest/run.py` against a real local stack.

The stack is `python -m tools.cli serve` (embedded Redis, prefill worker, a decode group of
two ranks with TPLA r=2, router) on free loopback ports, serving a tiny random DeepSeek-V2
checkpoint with a trained tokenizer and chat template, so the test needs no demo model.
The driver finds the stack ready and leaves it running; the test then stops it with SIGINT
and checks that every process it had started is gone.
"""

from __future__ import annotations

import csv
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.tiny import save_tiny_chat_model
from tools.local_stack import LocalStack

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny-smoke"
MAX_TOKENS = 16
STOP_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("smoke-model"))


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.NoSuchProcess:  # a short-lived helper process
        return ""


@pytest.fixture
def stack(model_dir: Path) -> Iterator[LocalStack]:
    s = LocalStack.start(
        model_dir,
        REPARAM="",
        TP="2",
        LATENT_GROUPS="2",
        SERVED_MODEL_NAME=MODEL_NAME,
        HOST="127.0.0.1",
        KV_BUDGET_MB="16",
    )
    try:
        yield s
    finally:
        s.stop()  # a failed test still stops everything


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _tail(stack: LocalStack) -> str:
    return "\n--- tpla serve output ---\n" + stack.log()[-4000:]


def _stats(path: Path) -> dict[str, dict[str, str]]:
    with path.open(newline="") as handle:
        return {f"{row['Type']} {row['Name']}": row for row in csv.DictReader(handle)}


def test_locust_smoke_20s_zero_failures(stack: LocalStack, tmp_path: Path) -> None:
    url, proc = stack.url, stack.proc
    for role in ("router", "prefill", "decode"):  # the image's HEALTHCHECK, on the real stack
        assert _healthcheck(role, stack.env) == 0, role + _tail(stack)
    # A port that accepts connections but does not answer the service's GetLoad is unhealthy.
    router_port = url.rsplit(":", 1)[1]
    assert _healthcheck("prefill", {**stack.env, "TPLA_PREFILL_PORT": router_port}) == 1
    processes = psutil.Process(proc.pid).children(recursive=True)
    names = " ".join(_cmdline(p) for p in processes)
    assert "redis-server" in names and "services.decode.group.follower" in names, names  # all of it

    # One user of each class, all spawned at once, prompts sized for the tiny context.
    cmd = [
        sys.executable,
        str(ROOT / "loadtest" / "run.py"),
        "--host",
        url,
        "--users",
        "3",
        "--spawn-rate",
        "3",
        "--run-time",
        "20s",
        "--stop-timeout",
        "15",
        "--results",
        str(tmp_path),
        "--prefix",
        "smoke",
        "--",
        "--model-name",
        MODEL_NAME,
        "--max-tokens",
        str(MAX_TOKENS),
        "--long-prompt-words",
        "120",
    ]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + _tail(stack)
    assert "starting" not in run.stdout  # it used the running stack

    stats = _stats(tmp_path / "smoke_stats.csv")
    total = stats[" Aggregated"]
    assert int(total["Request Count"]) > 0 and int(total["Failure Count"]) == 0, total
    for name in ("chat short", "chat long"):
        assert int(stats[f"POST {name}"]["Request Count"]) > 0, name
        for metric in ("TTFT", "ITL", "E2E"):
            assert int(stats[f"SSE {name} {metric}"]["Request Count"]) > 0, (name, metric)
        # ignore_eos: every stream carried exactly max_tokens tokens (E2E size = tokens).
        assert float(stats[f"SSE {name} E2E"]["Average Content Size"]) == MAX_TOKENS
    assert (tmp_path / "smoke.html").stat().st_size > 0
    assert httpx.get(f"{url}/ready", timeout=5).status_code == 200  # left running

    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=STOP_TIMEOUT_S) == 0, _tail(stack)
    deadline = time.monotonic() + 10
    alive = _alive(processes)
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = _alive(alive)
    assert not alive, [p.pid for p in alive]
    assert _healthcheck("router", stack.env) == 1
    assert _healthcheck("decode", stack.env) == 1


def _healthcheck(role: str, env: dict[str, str]) -> int:
    check = [sys.executable, str(ROOT / "docker" / "healthcheck.py"), role]
    return subprocess.run(check, env=env, capture_output=True, timeout=30, check=False).returncode


# Locust monkey-patches the standard library on import, so the locustfile's parser is
# exercised in a child interpreter, never in the pytest process.
PARSER_CHECK = r"""
import sys
sys.path.insert(0, "loadtest")
from locustfile import StreamError, read_stream

ok = [
    b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}', b"",
    b": keep-alive", b"",
    b'data: {"choices": [{"delta": {"content": "def"}}]}', b"",
    b'data: {"choices": [{"delta": {"content": " f"}, "finish_reason": "length"}]}', b"",
    b'data: {"choices": [], "usage": {"completion_tokens": 2}}', b"",
    b"data: [DONE]", b"",
]
r = read_stream(ok, 0.0)
got = (r.text, r.finish_reason, r.completion_tokens, len(r.text_times))
assert got == ("def f", "length", 2, 2), got
assert r.done_at is not None
bad = {
    "no done": ok[:-2],
    "in-band error": [b'data: {"error": {"message": "boom"}}', b"", b"data: [DONE]", b""],
    "not json": [b"data: {oops", b""],
}
for label, lines in bad.items():
    try:
        read_stream(lines, 0.0)
    except StreamError:
        continue
    raise SystemExit(f"accepted a stream with {label}")
print("parser ok")
"""


def test_locustfile_sse_parser() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PARSER_CHECK],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0 and "parser ok" in proc.stdout, proc.stdout + proc.stderr
