"""Loopback helpers for the local stack, tests and benchmarks: free ports, readiness."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable, Collection
from pathlib import Path

import httpx


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(
    offsets: tuple[int, ...] = (0,), attempts: int = 200, avoid: Collection[int] = ()
) -> int:
    """A port p on 127.0.0.1 with every p + offset free right now (services derive ports:
    metrics on +1000, KV receivers on +rank) and none of them in `avoid`: ports already
    chosen for services that have not bound them yet (separate calls hold nothing, so
    without it two services of one stack can be handed overlapping ports).

    Chosen below the OS's ephemeral range: a listening port picked from that range (as
    binding port 0 does) can be taken a moment later as the source port of any outgoing
    connection — a gloo pair, a Redis client — and a service that binds it late (a restarted
    decode group) then fails with EADDRINUSE. The search is bounded."""
    low, _ = _ephemeral_range()
    top = max(low - 1 - max(offsets), 10_001)
    for _ in range(attempts):
        base = random.randint(10_000, top)
        if any(base + off in avoid for off in offsets):
            continue
        held: list[socket.socket] = []
        try:
            for off in offsets:
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", base + off))
            return base
        except OSError:  # taken: try another base
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no free port with offsets {offsets} in {attempts} tries")


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports: separate `free_port()` calls hold nothing between them,
    so two of them can return the same port (a kv-transfer bench run once failed so)."""
    ports: list[int] = []
    while len(ports) < count:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


def wait_ready(url: str, died: Callable[[], str | None], timeout_s: float) -> None:
    """Poll GET {url}/ready until 200. `died()` names a process that exited (then this raises
    RuntimeError at once); TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (reason := died()) is not None:
            raise RuntimeError(reason)
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/ready did not answer 200 within {timeout_s:.0f} s")
