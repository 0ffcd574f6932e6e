"""Give the C heap's free memory back to the OS (glibc's `malloc_trim`), where there is one.

glibc keeps freed memory of its heaps for reuse, and after a large block is freed it serves
blocks up to that size from the heaps too (its dynamic mmap threshold), so a process that
ran a long prompt keeps holding what that prompt's temporaries left free. A prefill worker
trims after each chunked prompt (services/prefill/batch/progress.py says what it measured).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def trim_heap() -> bool:
    """Return the heaps' free pages to the OS; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
