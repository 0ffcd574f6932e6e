"""The whole stack as real processes: `tpla serve` on a tiny model, free loopback ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from services.decode.engine import free_port
from tests.model.tiny import save_tiny_chat_model

MODEL_NAME = "tiny-e2e"


@dataclass
class Stack:
    url: str
    model_dir: Path
    proc: subprocess.Popen
    env: dict[str, str]
    transport: str


def start_stack(model_dir: Path, transport: str) -> Stack:
    router_port = free_port()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TPLA_MODEL": str(model_dir),
        "TPLA_SERVED_MODEL_NAME": MODEL_NAME,
        "TPLA_REPARAM": "",
        "TPLA_TP": "2",
        "TPLA_LATENT_GROUPS": "2",
        "TPLA_TRANSPORT": transport,
        "TPLA_KV_BUDGET_MB": "8",
        "TPLA_ROUTER_PORT": str(router_port),
        "TPLA_PREFILL_PORT": str(free_port()),
        "TPLA_DECODE_PORT": str(free_port()),
        "TPLA_KV_PORT_BASE": str(free_port()),
        "TPLA_DIST_PORT": str(free_port()),
        "TPLA_HEARTBEAT_S": "0.5",
    }
    env.pop("TPLA_REDIS_URL", None)  # the embedded redis-server
    proc = subprocess.Popen(
        [sys.executable, "-m", "common.cli", "serve"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{router_port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tpla serve exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return Stack(url, model_dir, proc, env, transport)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_stack(proc)
    raise TimeoutError("the stack did not become ready")


def stop_stack(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return proc.stdout.read() if proc.stdout else ""


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("e2e-model"), std=0.08)


@pytest.fixture(scope="module")
def stack(tiny_model: Path) -> Iterator[Stack]:
    s = start_stack(tiny_model, "grpc")
    yield s
    stop_stack(s.proc)
