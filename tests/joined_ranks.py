"""Ranks of a group started on their own (`tpla decode|prefill --rank K --group-size 2
--group-addr 127.0.0.1:PORT`, or hosts of one, `--node K --nodes M`), each in a session of its
own with its log in a file: what the joined-group tests start, wait for and kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

START_S = 180.0


@dataclass
class Rank:
    proc: subprocess.Popen
    log: Path

    def text(self) -> str:
        return self.log.read_text()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout:g} s:\n{self.text()}") from None

    def wait_for(self, line: str, timeout: float = START_S) -> None:
        deadline = time.monotonic() + timeout
        while line not in self.text():
            assert self.proc.poll() is None, self.text()
            assert time.monotonic() < deadline, self.text()
            time.sleep(0.2)


def rank_starter(
    role: str, model_dir: Path, tmp_path: Path, base: dict[str, str], nodes: int = 0
) -> Iterator[Callable[..., Rank]]:
    """For a fixture: yields `start(rank, rendezvous, **settings)` (TPLA_<KEY> values over
    `base`), then kills whatever it started that is still running. With `nodes`, `rank` is
    a host of that many (`--node K --nodes M`: the host's first rank, spawning the rest)."""
    started: list[Rank] = []

    def start(rank: int, rendezvous: int, **settings: str) -> Rank:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TPLA_MODEL": str(model_dir)}
        env.pop("TPLA_REDIS_URL", None)  # no registry unless the test names one
        env.update({f"TPLA_{k}": v for k, v in {**base, **settings}.items()})
        log = tmp_path / f"rank{rank}-{len(started)}.log"
        argv = [sys.executable, "-m", "tools.cli", role]
        if nodes:
            argv += ["--node", str(rank), "--nodes", str(nodes)]
        else:
            argv += ["--rank", str(rank), "--group-size", "2"]
        argv += ["--group-addr", f"127.0.0.1:{rendezvous}"]
        with log.open("w") as out:
            proc = subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        started.append(Rank(proc, log))
        return started[-1]

    yield start
    for rank in started:
        if rank.proc.poll() is None:
            os.killpg(rank.proc.pid, signal.SIGKILL)
            rank.proc.wait(timeout=10)
