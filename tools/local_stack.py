"""`tpla serve` as a child process on free loopback ports: for tests, the soak and benchmarks.

    with LocalStack.start(model_dir, DECODE_GROUPS="2") as stack:
        httpx.post(f"{stack.url}/v1/chat/completions", ...)
        stack.workers()          # the registry as the router sees it (pids, groups, blocks)

Output goes to a log file, never a pipe: a chatty stack (tracebacks of killed ranks) must not
block on a pipe nobody reads. `stop()` sends SIGINT, which stops every child; SIGKILL after
a grace period.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from common.runtime.ports import SERVICE_PORT_OFFSETS, free_port, kv_port_offsets, wait_ready

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
        stack = cls.launch(model_dir, **settings)
        try:
            stack.wait_ready()
        except BaseException:
            stack.stop()
            raise
        return stack

    @classmethod
    def launch(cls, model_dir: Path | str, *args: str, **settings: str) -> LocalStack:
        """`start` without waiting for /ready (tests of start-up failures); `args` go on
        `tpla serve`'s command line (`--smoke`: one request, then it exits)."""
        # Room for what the services derive from each port (metrics on +1000, rank k's KV
        # receiver on base + k, torch stores on +100, a second group or worker on the
        # strides of services/stack/serve.py), none of it overlapping another service's.
        workers = tuple(w + off for w in (0, 1) for off in SERVICE_PORT_OFFSETS)
        kv = tuple(g * 200 + off for g in (0, 1) for off in kv_port_offsets(4))

        def pick(offsets: tuple[int, ...] = (0,)) -> str:
            return str(free_port(offsets))

        router_port = int(pick())
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "TPLA_MODEL": str(model_dir),
            "TPLA_ROUTER_PORT": str(router_port),
            "TPLA_PREFILL_PORT": pick(workers),
            "TPLA_DECODE_PORT": pick(workers),
            "TPLA_KV_PORT_BASE": pick(kv),
            "TPLA_DIST_PORT": pick((0, 10)),
            "TPLA_PREFILL_DIST_PORT": pick((0, 10)),
        }
        env.update({f"TPLA_{k}": str(v) for k, v in settings.items()})
        env.pop("TPLA_REDIS_URL", None)  # the embedded redis-server
        log_path = Path(tempfile.mkstemp(prefix="tpla-stack-", suffix=".log")[1])
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tools.cli", "serve", *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return cls(f"http://127.0.0.1:{router_port}", Path(model_dir), proc, env, log_path)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        def died() -> str | None:
            if self.proc.poll() is None:
                return None
            return f"tpla serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}"

        wait_ready(self.url, died, timeout_s)

    def log(self) -> str:
        """Everything the stack printed so far."""
        return self.log_path.read_text(errors="replace")

    def workers(self) -> list[dict]:
        return httpx.get(f"{self.url}/admin/workers", timeout=10).json()

    def stop(self) -> None:
        """SIGINT (the supervisor stops every child), SIGKILL after the grace period; then
        any child left over — they run in sessions of their own — is killed too."""
        if self.proc.poll() is not None:
            return
        import psutil  # a dev dependency, like every user of this module

        children = psutil.Process(self.proc.pid).children(recursive=True)
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                    child.kill()

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
