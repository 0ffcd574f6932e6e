"""The life of a decode group's shared-memory file (common/native/shm_group.py maps it).

A spawned group's leader makes the file (`new_path`) before its followers start; every rank
maps it by name. The name is needed only until the group's start-up barrier: by then every
rank has mapped the file, so the leader removes the name and a later crash leaves nothing in
/dev/shm. Whoever sees the group end before that removes it instead:

- the leader, when its start fails (`remove`);
- a follower that fails to start or sees its leader gone (`remove`);
- `tpla decode` on SIGTERM / SIGINT during start-up (`remove_files_of` its own pid);
- `tpla serve`'s supervisor once a decode child is gone (`remove_files_of` the child's pid).

A file is named after the pid of the group's leader, which creates it: whoever sees the
leader gone knows which file to remove. Torch-free, so `tpla serve`'s supervisor can clean up
after a decode child without importing torch.
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


def remove(path: str | None) -> None:
    """Remove a group file's name, if it is still there (the mappings live on); None, the
    path of a group without a file (one rank, or collectives over torch.distributed), is
    nothing to remove."""
    if path is None:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def remove_files_of(leader_pid: int) -> None:
    """Remove the names of every group file the process `leader_pid` created."""
    for path in files_of(leader_pid):
        remove(path)
