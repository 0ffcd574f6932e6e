"""`trim_heap` gives the C heap's free pages back to the OS where the C library is glibc
(this machine's): memory freed below a live block stays resident until it is called."""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

import psutil
import pytest

from common.runtime.heap import trim_heap

BLOCK, BLOCKS = 64 << 10, 1024  # 64 MiB in blocks below glibc's mmap threshold


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_heap_pages_go_back_to_the_os() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(BLOCK) for _ in range(BLOCKS)]
    fence = libc.malloc(BLOCK)  # live above them: glibc cannot shrink its heap's top
    try:
        for b in blocks:
            ctypes.memset(b, 1, BLOCK)  # resident
        for b in blocks:
            libc.free(b)
        held = psutil.Process().memory_info().rss
        assert trim_heap()
        returned = held - psutil.Process().memory_info().rss
        assert returned > (BLOCK * BLOCKS) // 2, f"only {returned >> 20} MiB returned"
    finally:
        libc.free(fence)
