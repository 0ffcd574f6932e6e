"""The ranks a host's first process spawns beside itself, as child processes.

The group's leader spawns the rest of its host's ranks (all of them in a spawned group); the
first rank of every other host of a joined group spawns the rest of its own (one pod per
node). Each child runs the service's follower command with its rank and its parent's pid
appended and the parent's config in its environment, joins the group as any rank does
(common/group/join.py) and ends when its parent dies (common/group/child.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

from common.group.child import START_ERROR_EXIT
from common.group.errors import RankExited
from common.group.spec import GroupSpec


class LocalRanks:
    """`follower`: the command that runs one spawned rank; `env`: what it adds to this
    process's environment (the rank's config)."""

    def __init__(
        self, spec: GroupSpec, first: int, follower: list[str], env: dict[str, str]
    ) -> None:
        self.spec, self.ranks = spec, spec.host_ranks(first)
        self._cmd, self._env = follower, env
        self._procs: dict[int, subprocess.Popen] = {}

    def start(self) -> None:
        env = {**os.environ, **self._env}
        for rank in self.ranks:
            argv = [sys.executable, *self._cmd, str(rank), str(os.getpid())]
            self._procs[rank] = subprocess.Popen(argv, env=env)

    def exit_code(self, rank: int) -> int | None:
        """Rank `rank`'s exit status if it is one of these and has ended, else None."""
        proc = self._procs.get(rank)
        return None if proc is None else proc.poll()

    def running(self, rank: int) -> bool:
        """False for one of these ranks that has ended; True for any other rank."""
        return self.exit_code(rank) is None

    def check(self) -> None:
        """RankExited for the first of these ranks that has ended."""
        for rank, proc in self._procs.items():
            if (code := proc.poll()) is not None:
                raise RankExited(f"{self.spec.role} rank {rank} exited with code {code}")

    def failed(self) -> tuple[int, int] | None:
        """(rank, exit code) of one of these ranks that ended with an error, if any: a rank
        ends with 0 only at its group's orderly end."""
        for rank, proc in self._procs.items():
            if (code := proc.poll()) is not None and code != 0:
                return rank, code
        return None

    def failed_to_start(self) -> int | None:
        """One of these ranks that ended after printing a start-up error, if any."""
        return next((k for k, p in self._procs.items() if p.returncode == START_ERROR_EXIT), None)

    def stop(self, grace_s: float) -> None:
        """Wait up to `grace_s` for each to end (the group's last plan ends it), then kill it."""
        for proc in self._procs.values():
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
