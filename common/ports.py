"""Loopback helpers for the local stack, tests and benchmarks: free ports, readiness."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import httpx


def free_port(offsets: tuple[int, ...] = (0,), attempts: int = 50) -> int:
    """A port p on 127.0.0.1 with every p + offset free right now (services derive ports:
    metrics on +1000, KV receivers on +rank). A race with another process is possible but
    rare; the search is bounded."""
    for _ in range(attempts):
        held: list[socket.socket] = []
        try:
            first = socket.socket()
            held.append(first)
            first.bind(("127.0.0.1", 0))
            base = int(first.getsockname()[1])
            for off in offsets:
                if off:
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
