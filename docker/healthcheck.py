"""Docker HEALTHCHECK for every role of the one tpla-serve image (stdlib only, < 1 s).

The role is the sub-command PID 1 runs (`tpla router|serve|prefill|decode`), read from
/proc/1/cmdline: the router (and `serve`, which fronts the stack with it) must answer
GET /health; prefill and decode workers must accept connections on their gRPC port, which
they open only once their model is loaded. Ports and host come from the TPLA_ settings.
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.request
from pathlib import Path

TIMEOUT_S = 3.0
ROLES = ("router", "serve", "prefill", "decode")


def role() -> str:
    if len(sys.argv) > 1:  # explicit role: tests, or a probe that knows it
        return sys.argv[1]
    args = Path("/proc/1/cmdline").read_bytes().split(b"\0")
    for arg in args:
        if arg.decode(errors="replace") in ROLES:
            return arg.decode()
    raise SystemExit(f"healthcheck: no tpla role in PID 1's command line {args!r}")


def target_host() -> str:
    host = os.environ.get("TPLA_HOST", "127.0.0.1")
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def main() -> int:
    which = role()
    if which not in ROLES:
        raise SystemExit(f"healthcheck: unknown role {which!r}; expected one of {ROLES}")
    host = target_host()
    if which in ("router", "serve"):
        port = int(os.environ.get("TPLA_ROUTER_PORT", "8000"))
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=TIMEOUT_S) as resp:
            return 0 if resp.status == 200 else 1
    default = "50051" if which == "prefill" else "50061"
    port = int(os.environ.get(f"TPLA_{which.upper()}_PORT", default))
    with socket.create_connection((host, port), timeout=TIMEOUT_S):
        return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except OSError as exc:  # refused, timed out, HTTP error status
        print(f"healthcheck: {exc}", file=sys.stderr)
        sys.exit(1)
