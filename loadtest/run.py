"""`make loadtest`: run the Locust workloads headless against a router, with reports.

    .venv/bin/python loadtest/run.py [--host URL] [--users N] [--spawn-rate R]
        [--run-time 60s] [--results DIR] [--prefix NAME] [USER_CLASS ...] [-- LOCUST ARGS]

Lifecycle: if nothing answers GET {host}/ready with 200 and the host is on this machine,
start the local stack (`tpla serve --port PORT`, env TPLA_* passed through) and wait for
it; run Locust headless as a subprocess (it monkey-patches the standard library with
gevent on import, so it never runs inside this process) writing CSV and HTML reports to
the results directory; stop the stack it started (SIGINT, then SIGKILL after a grace
period). Exits non-zero if the stack did not come up, Locust failed, or any request failed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LOCUSTFILE = HERE / "locustfile.py"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
STOP_GRACE_S = 30.0


def is_ready(host: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{host}/ready", timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):  # refused, 503, timed out
        return False


def wait_ready(host: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the stack exited with code {proc.returncode} during start-up")
        if is_ready(host):
            return
        time.sleep(1.0)
    raise TimeoutError(f"{host}/ready did not answer 200 within {timeout_s:.0f} s")


def stop_stack(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT lets `tpla serve` stop its children and Redis; SIGKILL is the fallback."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextlib.contextmanager
def local_stack(host: str, start_timeout_s: float) -> Iterator[bool]:
    """Yields whether this run started the stack; a running stack is left alone."""
    if is_ready(host):
        yield False
        return
    url = urlsplit(host)
    if url.hostname not in LOOPBACK:
        raise RuntimeError(f"{host} is not ready and is not on this machine: start it first")
    port = url.port or 80
    cmd = [sys.executable, "-m", "tools.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    print(f"loadtest: nothing ready at {host}; starting {' '.join(cmd[1:])}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # Its own session: a Ctrl-C meant for this driver must not also hit the stack's
    # processes mid-run; stop_stack ends it deliberately.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        wait_ready(host, proc, start_timeout_s)
        yield True
    finally:
        print("loadtest: stopping the stack it started", flush=True)
        stop_stack(proc)


def failures_in(stats_csv: Path) -> tuple[int, int]:
    """(requests, failures) of the Aggregated row of Locust's *_stats.csv."""
    with stats_csv.open(newline="") as handle:
        for row in csv.DictReader(handle):
            if row["Name"] == "Aggregated":
                return int(row["Request Count"]), int(row["Failure Count"])
    raise RuntimeError(f"no Aggregated row in {stats_csv}")


def locust_command(args: argparse.Namespace, prefix: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--host",
        args.host,
        "--users",
        str(args.users),
        "--spawn-rate",
        str(args.spawn_rate),
        "--run-time",
        args.run_time,
        # In-flight streams get this long to finish when the run time is up.
        "--stop-timeout",
        str(args.stop_timeout),
        "--csv",
        str(prefix),
        "--html",
        f"{prefix}.html",
        "--only-summary",
        "--exit-code-on-error",
        "1",
        *args.locust_args,
        *args.user_classes,
    ]


def seconds(text: str) -> float:
    """Locust's run-time syntax (90, 90s, 2m, 1h30m) in seconds."""
    total, number = 0.0, ""
    for ch in text.strip():
        if ch.isdigit():
            number += ch
        elif ch in "hms" and number:
            total += int(number) * {"h": 3600, "m": 60, "s": 1}[ch]
            number = ""
        else:
            raise argparse.ArgumentTypeError(f"bad run time {text!r}")
    return total + (int(number) if number else 0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    locust_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, locust_args = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--host", default=os.environ.get("TPLA_LOADTEST_HOST", "http://127.0.0.1:8000")
    )
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--spawn-rate", type=float, default=2.0)
    parser.add_argument("--run-time", default="60s")
    parser.add_argument("--stop-timeout", type=int, default=30)
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--prefix", help="report file prefix (default: tpla-<UTC time>)")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("user_classes", nargs="*", help="Locust user classes (default: all)")
    args = parser.parse_args(argv)
    args.locust_args = locust_args
    args.host = args.host.rstrip("/")
    try:
        seconds(args.run_time)  # validate early, before a stack is started
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.results.mkdir(parents=True, exist_ok=True)
    name = args.prefix or "tpla-" + datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    prefix = args.results / name
    # Locust stops itself after run-time + stop-timeout; the margin covers start-up.
    limit_s = seconds(args.run_time) + args.stop_timeout + 120
    try:
        with local_stack(args.host, args.start_timeout):
            cmd = locust_command(args, prefix)
            print(f"loadtest: {' '.join(cmd[1:])}", flush=True)
            code = subprocess.run(cmd, cwd=ROOT, timeout=limit_s, check=False).returncode
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as exc:
        print(f"loadtest: {exc}", file=sys.stderr, flush=True)
        return 1
    stats = Path(f"{prefix}_stats.csv")
    if not stats.exists():
        print(f"loadtest: locust wrote no {stats} (exit code {code})", file=sys.stderr)
        return code or 1
    total, failed = failures_in(stats)
    print(f"loadtest: {total} requests, {failed} failed; reports: {prefix}_*.csv, {prefix}.html")
    if code != 0 or failed or total == 0:
        return code or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
