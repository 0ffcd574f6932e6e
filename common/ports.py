"""Loopback port helpers for the local stack, tests and benchmarks."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it; a race is possible but rare)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
