"""Start-up failures on real processes: a taken port is named with the setting that moves it
and nothing is left running; a decode group that dies while it starts (its leader SIGKILLed,
the whole group SIGKILLed under `tpla serve`, SIGTERM, a taken KV port) leaves no
shared-memory file in /dev/shm.

Every process of a test carries the test's unique ports in its environment (children inherit
it), which is how the test finds them, waits for them and kills what is left. A decode
group's file is named after its leader's pid (`/dev/shm/tpla-group-<pid>-*`), so only files
of this test's processes are compared.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from common.group.errors import RankStartError
from common.native import shm_group
from common.parallel import ParallelConfig
from common.runtime.group_files import files_of
from common.runtime.ports import SERVICE_PORT_OFFSETS, PortInUse, free_port, kv_port_offsets
from services.decode.config import EngineConfig
from services.decode.engine import DecodeEngine
from tests.tiny import save_tiny_chat_model
from tools.local_stack import LocalStack

EXIT_TIMEOUT_S = 20.0
needs_shm = pytest.mark.skipif(not shm_group.available(), reason="no shared-memory collectives")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("startup-model"), std=0.08)


def processes(var: str, value: str) -> list[psutil.Process]:
    """Live processes (zombies hold nothing) whose environment has var=value, but this one."""
    found = []
    for proc in psutil.process_iter():
        try:
            if (
                proc.pid != os.getpid()
                and proc.status() != psutil.STATUS_ZOMBIE
                and proc.environ().get(var) == value
            ):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def group_files(pids: set[int]) -> list[str]:
    return [p for pid in pids for p in files_of(pid)]


def wait_for(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s:.0f} s")
        time.sleep(0.05)


class Watched:
    """The processes with var=value: every pid seen (polled), and a kill of what is left."""

    def __init__(self, var: str, value: str) -> None:
        self.var, self.value = var, value
        self.pids: set[int] = set()

    def poll(self) -> list[psutil.Process]:
        procs = processes(self.var, self.value)
        self.pids.update(p.pid for p in procs)
        return procs

    def kill_all(self) -> None:
        for proc in processes(self.var, self.value):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


@pytest.fixture
def stack_of(model: Path) -> Iterator[Callable[..., tuple[LocalStack, Watched]]]:
    """Launch `tpla serve` (not waiting for /ready); afterwards stop it and kill anything
    of it that is left, whatever the test asserted."""
    launched: list[tuple[LocalStack, Watched]] = []

    def launch(**settings: str) -> tuple[LocalStack, Watched]:
        defaults = {"SERVED_MODEL_NAME": "tiny-startup", "REPARAM": "", "KV_BUDGET_MB": "8"}
        stack = LocalStack.launch(model, **{**defaults, **settings})
        watched = Watched("TPLA_ROUTER_PORT", stack.env["TPLA_ROUTER_PORT"])
        launched.append((stack, watched))
        return stack, watched

    yield launch
    for stack, watched in launched:
        stack.stop()
        watched.kill_all()


def wait_exit(stack: LocalStack, watched: Watched) -> int:
    """tpla serve's exit code, polling its processes meanwhile; fails after EXIT_TIMEOUT_S."""
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while stack.proc.poll() is None:
        assert time.monotonic() < deadline, f"tpla serve still running:\n{stack.log()[-3000:]}"
        watched.poll()
        time.sleep(0.1)
    return stack.proc.returncode


def assert_nothing_left(watched: Watched) -> None:
    wait_for(lambda: not watched.poll(), 5, f"processes of the stack left: {watched.poll()}")
    assert not group_files(watched.pids), group_files(watched.pids)


def hold(port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


@pytest.mark.parametrize(
    ("setting", "offset", "purpose"),
    [
        ("DECODE_PORT", 0, "decode gRPC of group 0"),
        ("PREFILL_PORT", 1000, "prefill metrics of worker 0"),
        ("KV_PORT_BASE", 101, "KV TCPStore of rank 1 of group 0"),
    ],
)
def test_serve_names_a_taken_port_and_starts_nothing(
    stack_of, setting: str, offset: int, purpose: str
) -> None:
    port = free_port((0, 1, 100, 101, 1000))  # room for every port derived from it
    with hold(port + offset):
        stack, watched = stack_of(TP="2", **{setting: str(port)})
        started = time.monotonic()
        code = wait_exit(stack, watched)
    log = stack.log()
    assert code != 0
    assert time.monotonic() - started < EXIT_TIMEOUT_S
    expected = (
        f"tpla serve: error: port {port + offset} ({purpose}) is in use on 127.0.0.1; "
        f"set TPLA_{setting} to move it"
    )
    assert log.strip() == expected, log
    assert_nothing_left(watched)


def test_serve_stops_everything_when_a_child_finds_its_port_taken(stack_of) -> None:
    """A port taken after `tpla serve` checked it (a race): the child's one-line error, the
    whole stack stopped, no restart."""
    stack, watched = stack_of(TP="2")
    wait_for(lambda: "embedded redis-server on" in stack.log(), 20, "no redis-server line")
    port = int(stack.env["TPLA_DECODE_PORT"])
    with hold(port):  # the decode leader binds it seconds later, after its imports
        code = wait_exit(stack, watched)
    log = stack.log()
    assert code == 1, log
    assert (
        f"tpla decode: error: port {port} (decode gRPC) is in use on 127.0.0.1; "
        "set TPLA_DECODE_PORT to move it"
    ) in log
    assert "tpla serve: decode-0 cannot start (its error is above)" in log
    assert "Traceback" not in log and "restarting" not in log
    assert_nothing_left(watched)


def decode_leader(watched: Watched) -> psutil.Process | None:
    for proc in watched.poll():
        try:
            if "tools.cli decode" in " ".join(proc.cmdline()):
                return proc
        except psutil.NoSuchProcess:
            continue
    return None


@needs_shm
def test_serve_removes_the_file_of_a_group_killed_whole_during_start_up(stack_of) -> None:
    """Leader and followers SIGKILLed at once: no rank runs any code, `tpla serve` removes
    the file (named after the leader's pid) and stops."""
    stack, watched = stack_of(TP="2")
    wait_for(lambda: decode_leader(watched) is not None, 20, "no decode leader")
    leader = decode_leader(watched)
    assert leader is not None
    wait_for(lambda: group_files({leader.pid}) and leader.children(), 20, "no group file")
    os.killpg(leader.pid, signal.SIGKILL)  # its own session: the leader and its followers
    assert wait_exit(stack, watched) == 1
    assert "decode-0 exited with code -9 during start-up" in stack.log()
    assert_nothing_left(watched)


@needs_shm
def test_serve_stopped_during_start_up_stops_at_once_and_leaves_no_file(stack_of) -> None:
    """SIGINT (Ctrl-C) while the decode group starts: `tpla serve` does not wait for /ready,
    it stops every child and exits 0; the group's file goes."""
    stack, watched = stack_of(TP="2")
    wait_for(lambda: decode_leader(watched) is not None, 20, "no decode leader")
    leader = decode_leader(watched)
    assert leader is not None
    wait_for(lambda: group_files({leader.pid}) and leader.children(), 20, "no group file")
    stack.proc.send_signal(signal.SIGINT)
    assert wait_exit(stack, watched) == 0, stack.log()
    assert_nothing_left(watched)


def start_decode(model: Path) -> tuple[subprocess.Popen, Watched]:
    """`tpla decode` alone, tp=2, in a session of its own, on free ports."""
    port = free_port(SERVICE_PORT_OFFSETS)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TPLA_MODEL": str(model),
        "TPLA_REPARAM": "",
        "TPLA_KV_BUDGET_MB": "8",
        "TPLA_TP": "2",
        "TPLA_DECODE_PORT": str(port),
        "TPLA_KV_PORT_BASE": str(free_port(kv_port_offsets(2))),
        "TPLA_DIST_PORT": str(free_port()),
    }
    env.pop("TPLA_REDIS_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.cli", "decode"], env=env, start_new_session=True
    )
    return proc, Watched("TPLA_DECODE_PORT", str(port))


@pytest.fixture
def decode_group(model: Path) -> Iterator[Callable[[], tuple[subprocess.Popen, Watched]]]:
    started: list[tuple[subprocess.Popen, Watched]] = []

    def start() -> tuple[subprocess.Popen, Watched]:
        started.append(start_decode(model))
        return started[-1]

    yield start
    for proc, watched in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        watched.kill_all()


def wait_for_group_file(proc: subprocess.Popen, watched: Watched) -> None:
    """Until the leader made its group file and started its follower (before the barrier:
    the follower still imports torch then)."""
    wait_for(
        lambda: group_files({proc.pid}) and psutil.Process(proc.pid).children(),
        20,
        "no group file and follower",
    )
    watched.poll()


@needs_shm
def test_a_leader_killed_during_start_up_leaves_no_file(decode_group) -> None:
    """SIGKILL of the leader alone: its follower sees it gone, removes the file and exits."""
    proc, watched = decode_group()
    wait_for_group_file(proc, watched)
    proc.kill()
    proc.wait(timeout=10)
    wait_for(lambda: not group_files({proc.pid}), 15, "the group file is left")
    assert_nothing_left(watched)


@needs_shm
def test_a_group_stopped_during_start_up_leaves_no_file(decode_group) -> None:
    """SIGTERM to the whole group (a pod's stop) while the leader may sit in the rendezvous:
    it ends at once and removes the file; the followers follow."""
    proc, watched = decode_group()
    wait_for_group_file(proc, watched)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=10) == 128 + signal.SIGTERM
    assert not group_files({proc.pid})
    assert_nothing_left(watched)


@pytest.mark.parametrize(("rank", "offset"), [(0, 100), (1, 0)])
def test_a_taken_kv_port_fails_the_group_and_leaves_no_file(
    model: Path, capfd: pytest.CaptureFixture[str], rank: int, offset: int
) -> None:
    """Rank 0's TCPStore (the leader binds it) or rank 1's KV receiver (a follower): the
    group fails with the port and its setting named, and leaves no file. This process is the
    leader."""
    base = free_port(kv_port_offsets(2))
    port = base + offset + rank
    what = "KV TCPStore" if offset else "KV receiver"
    message = (
        f"port {port} ({what} of rank {rank}) is in use on 127.0.0.1; "
        "set TPLA_KV_PORT_BASE to move it"
    )
    cfg = EngineConfig(
        model=str(model),
        parallel=ParallelConfig(tp=2, latent_groups=1),
        master_port=0,
        kv_budget_mb=2,
        block_size=4,
        kv_port_base=base,
    )
    started = time.monotonic()
    with hold(port), pytest.raises(PortInUse if rank == 0 else RankStartError) as err:
        DecodeEngine(cfg)
    assert time.monotonic() - started < 30
    if rank == 0:
        assert str(err.value) == message
    else:
        # The follower's own reason, reported through the group's store.
        assert str(err.value) == f"decode rank 1 could not start: {message}"
        assert f"decode rank 1: error: {message}" in capfd.readouterr().err
    assert not group_files({os.getpid()})
