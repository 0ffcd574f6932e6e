"""How a test's spawned rank process ends: it leaves its process group with its peers, its
results leave through their queue, and it exits past the interpreter's teardown, which a gloo
thread can turn into SIGABRT (`end_process`)."""

from __future__ import annotations

import multiprocessing as mp
from typing import NoReturn

import torch.distributed as dist

from common.group.child import end_process


def leave_group(out: mp.Queue) -> NoReturn:
    # The barrier first: a gloo rank whose peer (or the store on rank 0) is gone mid-collective
    # fails. Then the queue's feeder thread must deliver before os._exit drops it.
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    out.close()
    out.join_thread()
    end_process(0)
