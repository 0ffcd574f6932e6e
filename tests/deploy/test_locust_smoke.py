"""A 20-second Locust smoke run through `loadtest/run.py` against a real local stack.

The stack is `python -m common.cli serve` (embedded Redis, prefill worker, a decode group of
two ranks with TPLA r=2, router) on free loopback ports, serving a tiny random DeepSeek-V2
checkpoint with a trained tokenizer and chat template, so the test needs no demo model.
The driver finds the stack ready and leaves it running; the test then stops it with SIGINT
and checks that every process it had started is gone.
"""

from __future__ import annotations

import csv
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from tests.model.tiny import save_tiny_chat_model

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny-smoke"
MAX_TOKENS = 16
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0


def free_port(offsets: tuple[int, ...] = (0,), attempts: int = 50) -> int:
    """A port p with every p + offset free on 127.0.0.1 right now (bounded tries)."""
    for _ in range(attempts):
        held: list[socket.socket] = []
        try:
            first = socket.socket()
            held.append(first)
            first.bind(("127.0.0.1", 0))
            base = first.getsockname()[1]
            for off in offsets[1:]:
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", base + off))
            return base
        except OSError:  # an offset port is taken (or out of range): try another base
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no free port with offsets {offsets} in {attempts} tries")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("smoke-model"))


def _wait_ready(stack: Stack) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        code = stack.proc.poll()
        assert code is None, f"tpla serve exited with {code} during start-up{stack.tail()}"
        try:
            if httpx.get(f"{stack.url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"/ready not 200 within {READY_TIMEOUT_S:.0f} s{stack.tail()}")


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.NoSuchProcess:  # a short-lived helper process
        return ""


@dataclass
class Stack:
    url: str
    proc: subprocess.Popen[bytes]
    env: dict[str, str]
    log: Path

    def tail(self) -> str:
        """The end of the stack's output, for failure messages."""
        return "\n--- tpla serve output ---\n" + self.log.read_text(errors="replace")[-4000:]


@pytest.fixture
def stack(model_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    # Ports derived from the configured ones must be free too: `tpla serve` puts its
    # embedded Redis on router port + 1399, workers serve metrics on gRPC port + 1000, and
    # the decode ranks receive KV on kv_base + rank (the torch transport's stores at +100
    # are not opened: this stack uses gRPC).
    router = free_port((0, 1399))
    prefill = free_port((0, 1000))
    decode = free_port((0, 1000))
    kv_base = free_port((0, 1))
    dist = free_port()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TPLA_MODEL": str(model_dir),
        "TPLA_REPARAM": "",
        "TPLA_TP": "2",
        "TPLA_LATENT_GROUPS": "2",
        "TPLA_SERVED_MODEL_NAME": MODEL_NAME,
        "TPLA_HOST": "127.0.0.1",
        "TPLA_ROUTER_PORT": str(router),
        "TPLA_PREFILL_PORT": str(prefill),
        "TPLA_DECODE_PORT": str(decode),
        "TPLA_KV_PORT_BASE": str(kv_base),
        "TPLA_DIST_PORT": str(dist),
        "TPLA_KV_BUDGET_MB": "16",
    }
    env.pop("TPLA_REDIS_URL", None)  # the stack embeds its own
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "common.cli", "serve"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield Stack(f"http://127.0.0.1:{router}", proc, env, log)
    finally:
        if proc.poll() is None:  # a failed test: still stop everything
            # The children run in sessions of their own: find them before the parent goes.
            children = psutil.Process(proc.pid).children(recursive=True)
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
            for child in _alive(children):
                child.kill()


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _stats(path: Path) -> dict[str, dict[str, str]]:
    with path.open(newline="") as handle:
        return {f"{row['Type']} {row['Name']}": row for row in csv.DictReader(handle)}


def test_locust_smoke_20s_zero_failures(stack: Stack, tmp_path: Path) -> None:
    url, proc = stack.url, stack.proc
    _wait_ready(stack)
    for role in ("router", "prefill", "decode"):  # the image's HEALTHCHECK, on the real stack
        assert _healthcheck(role, stack.env) == 0, role + stack.tail()
    processes = psutil.Process(proc.pid).children(recursive=True)
    names = " ".join(_cmdline(p) for p in processes)
    assert "redis-server" in names and "services.decode.runtime" in names, names  # all of it

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
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + stack.tail()
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
    assert proc.wait(timeout=STOP_TIMEOUT_S) == 0, stack.tail()
    deadline = time.monotonic() + 10
    alive = _alive(processes)
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = _alive(alive)
    assert not alive, [p.pid for p in alive]
    assert _healthcheck("router", stack.env) == 1


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
