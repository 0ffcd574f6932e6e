"""The names of decode groups' shared-memory files (common/native/shm_group.py maps them).

Torch-free, so `tpla serve`'s supervisor can clean up after a decode child without importing
torch. A file is named after the pid of the group's leader, which creates it: whoever sees
the leader gone (its followers, the supervisor) knows which file to remove.
"""

from __future__ import annotations

import contextlib
import glob
import os
import uuid

PREFIX = "/dev/shm/tpla-group-"


def new_path() -> str:
    """A fresh name for a group's file, in tmpfs (the exchange never touches a disk)."""
    return f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}"


def files_of(leader_pid: int) -> list[str]:
    """The group files the process `leader_pid` created and that still have a name."""
    return glob.glob(f"{PREFIX}{leader_pid}-*")


def remove(path: str) -> None:
    """Remove a group file's name, if it is still there (the mappings live on)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def remove_files_of(leader_pid: int) -> None:
    for path in files_of(leader_pid):
        remove(path)
