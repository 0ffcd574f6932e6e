"""A process's memory as Linux reports it in /proc/PID/status (VmRSS, VmHWM).

Not `ru_maxrss` where /proc exists: Linux carries a parent's peak over fork and exec into the
child, so a child of a big parent would report the parent's."""

from __future__ import annotations

import os
import resource
from pathlib import Path


def vm_bytes(pid: int, key: str) -> int:
    """A /proc/PID/status size in bytes (VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} for process {pid}")


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM)."""
    try:
        return vm_bytes(os.getpid(), "VmHWM")
    except OSError:  # not Linux: no /proc
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB too
