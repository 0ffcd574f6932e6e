"""`tpla serve` / `make serve`: the whole stack on one machine, supervised.

Starts an embedded redis-server when TPLA_REDIS_URL is unset, then a decode group, a
prefill worker and the router as child processes (each in its own process group, so a stop
reaches every rank), waits for the router's /ready, and prints how to use it. A child that
dies is reported and restarted (every service re-registers with Redis on start): at once
whenever it had served (its port had opened: a fault, a kill, not a crash loop), and only
`MAX_RESTARTS` times in a row while it dies before serving. SIGINT/SIGTERM stops every child
within a few seconds, during start-up too.

Start-up failures are not retried: every port the stack binds is checked before anything
starts (a taken one is named with the setting that moves it), and a child that exits during
start-up, or later with the CLI's error code (a configuration or port error it would only
repeat), stops the whole stack. A decode group's shared-memory file, named after its leader's
pid, is removed once the leader is gone, however it ended.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

from common.loading.side_file_choice import NONE, resolve_reparam
from common.rpc.server import stop_on_signals
from common.runtime import group_files
from common.runtime.ports import (
    METRICS_PORT_OFFSET,
    TORCH_PORT_OFFSET,
    PortUse,
    check_ports,
    decode_group_ports,
    free_port,
    prefill_worker_ports,
    router_port,
    wait_ready,
)
from common.runtime.settings import Settings
from services.stack.devices import StackDevices
from services.stack.embedded_redis import EmbeddedRedis

STOP_GRACE_S = 5.0
READY_TIMEOUT_S = 300.0
MAX_RESTARTS = 3  # in a row, of a child that dies before its port opens
# `tpla` exits 2 after printing a configuration error (tools/cli/main.py main): a port in use, a
# missing model. Restarting the child would only print it again.
CONFIG_ERROR_EXIT = 2
# The embedded Redis of the default stack (router on 8000); any other stack takes a free port.
DEFAULT_REDIS_PORT = 6399


@dataclass
class Child:
    name: str
    args: list[str]
    port: int  # its service's, which opens once it serves (after loading)
    host: str = "127.0.0.1"  # where to reach that port
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)  # over the stack's (its device)
    served: bool = False  # its port has opened since its last start
    failed_starts: int = 0  # starts in a row that died before serving

    def start(self, env: dict[str, str]) -> None:
        self.served = False
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tools.cli", *self.args],
            env={**env, **self.env},
            start_new_session=True,
        )

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        _signal_group(self.proc, signal.SIGTERM)

    def check_served(self) -> None:
        """Note whether its port has opened (a TCP connect, refused until then)."""
        if not self.served:
            with contextlib.suppress(OSError):
                socket.create_connection((self.host, self.port), timeout=0.2).close()
                self.served = True

    def remove_leftovers(self) -> None:
        """Once the process is gone: any shared-memory file a decode leader named after its
        pid. Its followers remove the file when they see it die, but a group killed as a
        whole (its process group SIGKILLed, a SIGTERM during start-up) runs no code of its
        own."""
        if self.proc is not None:
            group_files.remove_files_of(self.proc.pid)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _env(s: Settings, redis_url: str) -> dict[str, str]:
    env = dict(os.environ)
    values = {
        "MODEL": s.model,
        "REDIS_URL": redis_url,
        "HOST": s.host,
        "TP": s.tp,
        "LATENT_GROUPS": s.latent_groups,
        "PARALLEL": s.parallel,
        "RMSNORM": s.rmsnorm,
        "REPARAM": s.reparam,
        "TRANSPORT": s.transport,
        "ROUTER_PORT": s.router_port,
        "PREFILL_PORT": s.prefill_port,
        "PREFILL_TP": s.prefill_tp,
        "DECODE_PORT": s.decode_port,
        "KV_PORT_BASE": s.kv_port_base,
        "DIST_PORT": s.dist_port,
        "TORCH_THREADS": s.torch_threads,
        "PREFILL_THREADS": s.prefill_threads,
        "PREFILL_BATCH_TOKENS": s.prefill_batch_tokens,
        "KV_BUDGET_MB": s.kv_budget_mb,
        "MAX_BATCH": s.max_batch,
        "PREFIX_CACHE": s.prefix_cache,
        "PREFIX_CACHE_MB": s.prefix_cache_mb,
    }
    env.update({f"TPLA_{k}": str(v) for k, v in values.items()})
    env.setdefault("OMP_NUM_THREADS", str(s.torch_threads))
    if s.prefill_threads > s.torch_threads:
        # A prefill worker's OpenMP threads then share the cores with the decode ranks; spinning
        # while they wait for each other took a core from a rank (measured with 2 threads on the
        # 2-core VM: short-prompt throughput 265 vs 303-313 tok/s spinning vs sleeping;
        # benchmarks/serve.md).
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


# Port strides between the instances of one kind, so groups and workers never collide: a
# decode group uses its gRPC port (+1000 metrics), tp KV receivers and tp TCPStores
# (kv base + rank, + 100 + rank) and one rendezvous port.
DECODE_PORT_STRIDE = 1
KV_PORT_STRIDE = 200
DIST_PORT_STRIDE = 10
PREFILL_PORT_STRIDE = 1


@dataclass(frozen=True)
class StackPorts:
    """Each decode group's gRPC, KV-base and rendezvous port, each prefill worker's port, and
    every port the stack's services bind."""

    decode: list[int]
    kv: list[int]
    dist: list[int]
    prefill: list[int]
    prefill_dist: list[int]  # each prefill worker's group rendezvous
    used: list[int]


def stack_ports(s: Settings) -> StackPorts:
    """The ports `s` gives the local stack; ValueError if two services would share one."""
    decode = [s.decode_port + i * DECODE_PORT_STRIDE for i in range(s.decode_groups)]
    kv = [s.kv_port_base + i * KV_PORT_STRIDE for i in range(s.decode_groups)]
    dist = [s.dist_port + i * DIST_PORT_STRIDE for i in range(s.decode_groups)]
    prefill = [s.prefill_port + j * PREFILL_PORT_STRIDE for j in range(s.prefill_workers)]
    prefill_dist = [s.prefill_dist_port + j * DIST_PORT_STRIDE for j in range(s.prefill_workers)]
    used = [
        s.router_port,
        *decode,
        *(p + METRICS_PORT_OFFSET for p in (*decode, *prefill)),
        *(base + off + r for base in kv for off in (0, TORCH_PORT_OFFSET) for r in range(s.tp)),
        *dist,
        *prefill,
        *(prefill_dist if s.prefill_tp > 1 else []),
    ]
    if len(set(used)) != len(used):
        raise ValueError(
            f"{s.decode_groups} decode groups and {s.prefill_workers} prefill workers need "
            "more room between the configured ports (TPLA_*_PORT, TPLA_KV_PORT_BASE)"
        )
    return StackPorts(decode, kv, dist, prefill, prefill_dist, used)


def stack_port_uses(s: Settings) -> list[PortUse]:
    """Every port the stack's services bind on s.host, with what it is for."""
    ports = stack_ports(s)
    uses = [router_port(s.router_port)]
    for i, (d, k, m) in enumerate(zip(ports.decode, ports.kv, ports.dist, strict=True)):
        uses += decode_group_ports(d, k, m, s.tp, f" of group {i}")
    for j, (p, m) in enumerate(zip(ports.prefill, ports.prefill_dist, strict=True)):
        uses += prefill_worker_ports(p, f" of worker {j}", m, s.prefill_tp)
    return uses


def stack_children(s: Settings, devices: StackDevices | None = None) -> list[Child]:
    """The local stack's processes: decode groups, prefill workers, then the router. With
    `devices`, each decode group and prefill worker is started on its own (TPLA_DEVICE)."""
    ports = stack_ports(s)
    host = "127.0.0.1" if s.host in ("0.0.0.0", "::", "") else s.host  # bound to every address

    def on(device: str | None) -> dict[str, str]:
        return {"TPLA_DEVICE": device} if device else {}

    decode = devices.decode if devices else (None,) * s.decode_groups
    prefill = devices.prefill if devices else (None,) * s.prefill_workers
    groups = [
        Child(
            f"decode-{i}",
            ["decode", "--port", str(d), "--kv-port-base", str(k), "--dist-port", str(m)],
            d,
            host,
            env=on(device),
        )
        for i, (d, k, m, device) in enumerate(
            zip(ports.decode, ports.kv, ports.dist, decode, strict=True)
        )
    ]
    workers = [
        Child(
            f"prefill-{j}",
            ["prefill", "--port", str(p), "--dist-port", str(m)],
            p,
            host,
            env=on(device),
        )
        for j, (p, m, device) in enumerate(
            zip(ports.prefill, ports.prefill_dist, prefill, strict=True)
        )
    ]
    return [*groups, *workers, Child("router", ["router"], s.router_port, host)]


def _exited(children: list[Child]) -> str | None:
    for child in children:
        if child.proc is not None and (code := child.proc.poll()) is not None:
            if code == CONFIG_ERROR_EXIT:
                return f"{child.name} cannot start (its error is above)"
            return f"{child.name} exited with code {code} during start-up"
    return None


def _smoke(url: str, model: str) -> None:
    body = {
        "model": model,
        "max_tokens": 24,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Write a Python function `add`"}],
    }
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    print(resp.text, flush=True)
    resp.raise_for_status()


def serve_stack(s: Settings, *, smoke: bool = False, devices: StackDevices | None = None) -> int:
    """Run the stack until SIGINT/SIGTERM; the exit code. PortInUse (a ValueError: the CLI
    prints it) before anything starts if a port the stack binds is taken. `devices`: where
    each decode group and prefill worker runs (None: each resolves TPLA_DEVICE itself)."""
    check_ports(s.host, stack_port_uses(s))
    # The side file is chosen here, once: a missing one is said once (or, named, fails here),
    # and every service then reads the same choice.
    s = s.model_copy(update={"reparam": resolve_reparam(s.model, s.reparam) or NONE})
    default_redis = not s.redis_url and s.router_port == 8000
    if default_redis:
        redis_use = PortUse(
            DEFAULT_REDIS_PORT,
            "the embedded redis-server",
            "TPLA_REDIS_URL (a running Redis) or TPLA_ROUTER_PORT",
        )
        check_ports("127.0.0.1", [redis_use])
    stop = threading.Event()
    stop_on_signals(stop)
    redis_server = None
    redis_url = s.redis_url
    if not redis_url:
        # The default stack's Redis has a well-known port; any other stack (tests, benchmarks
        # on free ports) takes a free one. A random password, since any local user can reach
        # a loopback port; children get the URL in their environment, never on a command line.
        redis_server = EmbeddedRedis(
            port=DEFAULT_REDIS_PORT if default_redis else free_port(avoid=stack_ports(s).used),
            password=secrets.token_urlsafe(24),
        )
        redis_url = redis_server.url
        print(
            f"embedded redis-server on 127.0.0.1:{redis_server.port} (password in the "
            "children's TPLA_REDIS_URL)",
            flush=True,
        )
    env = _env(s, redis_url)
    children = stack_children(s, devices)
    url = f"http://{s.host}:{s.router_port}"
    code = 0
    try:
        for child in children:
            child.start(env)

        def failed() -> str | None:  # a stop request ends the wait for /ready too
            return "stopped during start-up" if stop.is_set() else _exited(children)

        wait_ready(url, failed, READY_TIMEOUT_S)
        print(
            f"\ntpla-serve is ready: {url}  (model {s.served_model_name!r}, "
            f"{s.decode_groups} decode group(s) of tp={s.tp}, {s.prefill_workers} prefill, "
            f"latent groups={s.latent_groups}, {s.transport} KV transport)\n"
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f'    -d \'{{"model": "{s.served_model_name}", "messages": [{{"role": '
            f'"user", "content": "Write a Python function `is_prime`: Return True if n is a '
            f"prime number.\"}}]}}'\n"
            "Ctrl-C stops everything.",
            flush=True,
        )
        if smoke:
            _smoke(url, s.served_model_name)
            return 0
        while not stop.wait(1.0):
            if redis_server is not None and redis_server.proc.poll() is not None:
                # Workers re-register with their next heartbeat; records start empty.
                print("tpla serve: embedded redis-server exited; restarting it", flush=True)
                redis_server.stop()  # removes its data directory
                redis_server = EmbeddedRedis(redis_server.port, redis_server.password)
            supervise(children, env)
    except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
        if not stop.is_set():  # a requested stop is no failure
            print(f"tpla serve: {exc}", file=sys.stderr, flush=True)
            code = 1
    finally:
        _stop_all(children)
        if redis_server is not None:
            redis_server.stop()
    return code


def supervise(children: list[Child], env: dict[str, str]) -> None:
    """One look at every child (the stack's loop calls it every second): a running one's port
    checked until it serves, one that exited restarted, or the stack given up on (raises)."""
    for child in children:
        if child.proc is None:
            continue
        if child.proc.poll() is None:
            child.check_served()
            continue
        code = child.proc.returncode
        print(f"tpla serve: {child.name} exited with code {code}", flush=True)
        _signal_group(child.proc, signal.SIGKILL)  # its ranks, if any, go with it
        child.remove_leftovers()
        if code == CONFIG_ERROR_EXIT:
            raise RuntimeError(f"{child.name} cannot start (its error is above); not restarting it")
        child.failed_starts = 0 if child.served else child.failed_starts + 1
        if child.failed_starts >= MAX_RESTARTS:
            raise RuntimeError(f"{child.name} keeps failing before it serves; giving up")
        print(f"tpla serve: restarting {child.name}", flush=True)
        child.start(env)


def _stop_all(children: list[Child]) -> None:
    for child in children:
        child.stop()
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        if child.proc is None:
            continue
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        _signal_group(child.proc, signal.SIGKILL)  # ranks of a stuck group, stragglers
        child.proc.wait(timeout=5)
        child.remove_leftovers()
