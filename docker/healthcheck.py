"""Docker HEALTHCHECK for every role of the one tpla-serve image (< 1 s).

The role is the sub-command PID 1 runs (`tpla router|serve|prefill|decode`), read from
/proc/1/cmdline: the router (and `serve`, which fronts the stack with it) must answer
GET /health; a prefill worker and a decode leader must answer their service's GetLoad on the
gRPC port they open once their model is loaded (a decode leader answers it from its loop
thread, so a group whose loop hangs fails the check, where an accepted connection would not
tell); a decode follower started on its own (`decode --rank K` or a host of a group over
hosts, `decode --node K`, K > 0) must accept connections on its (first rank's) KV receiver
port, opened once it has joined its group and loaded its share; a prefill follower serves no
port (it is healthy while it runs). Ports, host and the internal token come from the TPLA_
settings.
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import urllib.request
from pathlib import Path

TIMEOUT_S = 3.0
ROLES = ("router", "serve", "prefill", "decode")


def command() -> list[str]:
    if len(sys.argv) > 1:  # explicit role (and flags): tests, or a probe that knows it
        return sys.argv[1:]
    return [a.decode(errors="replace") for a in Path("/proc/1/cmdline").read_bytes().split(b"\0")]


def role(args: list[str]) -> str:
    for arg in args:
        if arg in ROLES:
            return arg
    raise SystemExit(f"healthcheck: no tpla role in PID 1's command line {args!r}")


def follower_rank(args: list[str]) -> bool:
    """A rank other than the leader: `--rank K` or `--node K` (or TPLA_RANK, TPLA_NODE) with
    K > 0."""
    place = {"--rank": os.environ.get("TPLA_RANK", "0"), "--node": os.environ.get("TPLA_NODE", "0")}
    for flag, value in itertools.pairwise(args):
        if flag in place:
            place[flag] = value
    return any(v.isdigit() and int(v) > 0 for v in place.values())


def target_host() -> str:
    host = os.environ.get("TPLA_HOST", "127.0.0.1")
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def main() -> int:
    args = command()
    which = role(args)
    host = target_host()
    if which in ("router", "serve"):
        port = int(os.environ.get("TPLA_ROUTER_PORT", "8000"))
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=TIMEOUT_S) as resp:
            return 0 if resp.status == 200 else 1
    if which in ("decode", "prefill") and follower_rank(args):
        if which == "prefill":
            return 0
        port = int(os.environ.get("TPLA_KV_PORT_BASE", "50071"))
        with socket.create_connection((host, port), timeout=TIMEOUT_S):
            return 0
    default = "50051" if which == "prefill" else "50061"
    port = int(os.environ.get(f"TPLA_{which.upper()}_PORT", default))
    return get_load(which, f"{host}:{port}")


def get_load(which: str, address: str) -> int:
    """The service's GetLoad within TIMEOUT_S: 0 when it answers."""
    import grpc

    from common.rpc.clients import TOKEN_METADATA_KEY
    from common.rpc.gen import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

    token = os.environ.get("TPLA_INTERNAL_TOKEN")
    metadata = ((TOKEN_METADATA_KEY, token),) if token else ()
    with grpc.insecure_channel(address) as channel:
        stub_class = (
            prefill_pb2_grpc.PrefillStub if which == "prefill" else decode_pb2_grpc.DecodeStub
        )
        try:
            stub_class(channel).GetLoad(common_pb2.Empty(), timeout=TIMEOUT_S, metadata=metadata)
        except grpc.RpcError as exc:
            print(f"healthcheck: {which} GetLoad at {address}: {exc.code().name}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except OSError as exc:  # refused, timed out, HTTP error status
        print(f"healthcheck: {exc}", file=sys.stderr)
        sys.exit(1)
