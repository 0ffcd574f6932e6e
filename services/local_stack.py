"""`tpla serve` as a child process on free loopback ports: for tests, the soak and benchmarks.

    with LocalStack.start(model_dir, DECODE_GROUPS="2") as stack:
        httpx.post(f"{stack.url}/v1/chat/completions", ...)
        stack.workers()          # the registry as the router sees it (pids, groups, blocks)

Output goes to a log file, never a pipe: a chatty stack (tracebacks of killed ranks) must not
block on a pipe nobody reads. `stop()` sends SIGINT, which stops every child; SIGKILL after
a grace period.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from common.ports import free_port

READY_TIMEOUT_S = 300.0
STOP_GRACE_S = 30.0


@dataclass
class LocalStack:
    url: str
    model_dir: Path
    proc: subprocess.Popen
    env: dict[str, str]
    log_path: Path

    @classmethod
    def start(cls, model_dir: Path | str, **settings: str) -> LocalStack:
        """Start `tpla serve` on free ports with TPLA_<KEY>=value for each keyword (e.g.
        DECODE_GROUPS="2") and the embedded Redis; return once /ready answers 200."""
        router_port = free_port()
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "TPLA_MODEL": str(model_dir),
            "TPLA_ROUTER_PORT": str(router_port),
            "TPLA_PREFILL_PORT": str(free_port()),
            "TPLA_DECODE_PORT": str(free_port()),
            "TPLA_KV_PORT_BASE": str(free_port()),
            "TPLA_DIST_PORT": str(free_port()),
        }
        env.update({f"TPLA_{k}": str(v) for k, v in settings.items()})
        env.pop("TPLA_REDIS_URL", None)  # the embedded redis-server
        log_path = Path(tempfile.mkstemp(prefix="tpla-stack-", suffix=".log")[1])
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "common.cli", "serve"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        stack = cls(f"http://127.0.0.1:{router_port}", Path(model_dir), proc, env, log_path)
        try:
            stack.wait_ready()
        except BaseException:
            stack.stop()
            raise
        return stack

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tpla serve exited early:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the stack was not ready within {timeout_s:.0f} s")

    def log(self) -> str:
        """Everything the stack printed so far."""
        return self.log_path.read_text(errors="replace")

    def workers(self) -> list[dict]:
        return httpx.get(f"{self.url}/admin/workers", timeout=10).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
