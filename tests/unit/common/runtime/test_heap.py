"""`trim_heap` returns the C heap's free memory where the C library is glibc (this machine's)."""

from __future__ import annotations

import platform

import pytest

from common.runtime.heap import trim_heap


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trims_on_glibc() -> None:
    assert trim_heap()
    assert trim_heap()  # repeatable, and cheap when nothing is free
