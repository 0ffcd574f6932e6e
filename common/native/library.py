"""Compile a C++ source of this package into a shared library once per machine, and load it.

No torch headers, no pybind: the kernels take raw pointers through ctypes, so a build is one
`g++` call of a few seconds (at `make install`, or on first use). Libraries are cached under
the user's cache directory ($XDG_CACHE_HOME, else ~/.cache), keyed by the source, the flags
and the compiler. Two kinds:

* native (the default): `-march=native`, keyed also by the CPU's model and feature flags, so
  it never runs on a CPU it was not built for;
* portable (`python -m common.native.library --portable`, for container images built on
  another machine): x86-64-v3 (AVX2 + FMA), loaded only where the CPU has both.

Without a usable library and without a compiler, callers get `NativeUnavailable` and keep
their pure-PyTorch path.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fno-math-errno")
PORTABLE_FLAGS = ("-march=x86-64-v3",)
PORTABLE_CPU_FLAGS = {"avx2", "fma"}


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here; use the PyTorch path."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tpla-serve" / "native"


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()


def _cpu_signature() -> str:
    """What `-march=native` depends on: the CPU's model and feature flags."""
    lines = {ln for ln in _cpuinfo().splitlines() if ln.startswith(("model name", "flags"))}
    return platform.machine() + "".join(sorted(lines))


def _cpu_flags() -> set[str]:
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _compiler() -> str:
    for name in ("c++", "g++", "clang++"):
        if path := shutil.which(name):
            return path
    raise NativeUnavailable("no C++ compiler on PATH (install g++ for the native kernels)")


def _target(name: str, portable: bool, cxx: str | None) -> Path:
    """The cached library's path; the portable one's key needs no compiler (it is looked
    up on machines that have none)."""
    # The shared headers are part of every source (a changed tile rebuilds every kernel).
    headers = [h.read_text() for h in sorted(SOURCE_DIR.glob("*.h"))]
    source = "\0".join([(SOURCE_DIR / f"{name}.cpp").read_text(), *headers])
    if portable:
        parts = [source, " ".join(FLAGS + PORTABLE_FLAGS)]
    else:
        assert cxx is not None
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
        parts = [source, " ".join((*FLAGS, "-march=native")), version, _cpu_signature()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    kind = "portable" if portable else "native"
    return cache_dir() / f"lib{name}-{kind}-{key}.so"


def build(name: str, portable: bool = False) -> Path:
    """Compile `<name>.cpp` next to this file (unless cached) and return the library path."""
    cxx = _compiler()
    target = _target(name, portable, cxx)
    if target.exists():
        return target
    flags = FLAGS + (PORTABLE_FLAGS if portable else ("-march=native",))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build to a temporary name and rename: several decode ranks may build at once.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as exc:
        raise NativeUnavailable(f"cannot write the kernel cache {target.parent}: {exc}") from exc
    try:
        done = subprocess.run(
            [cxx, *flags, str(SOURCE_DIR / f"{name}.cpp"), "-o", tmp],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise NativeUnavailable(f"building {name}.cpp failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(name: str) -> ctypes.CDLL:
    """A native build for this CPU (compiled now if needed); on a machine without a
    compiler, a portable build from the cache if the CPU can run it."""
    try:
        path = build(name)
    except NativeUnavailable:
        portable = _target(name, True, None)
        if not (portable.exists() and _cpu_flags() >= PORTABLE_CPU_FLAGS):
            raise
        path = portable
    try:
        return ctypes.CDLL(str(path), use_errno=True)
    except OSError as exc:
        raise NativeUnavailable(f"loading the {name} library failed: {exc}") from exc


def load_optional(name: str, functions: dict[str, list], purpose: str) -> ctypes.CDLL | None:
    """`load(name)` with each function's argument types set (all return int), or None after
    a warning that `purpose` runs on PyTorch instead."""
    try:
        lib = load(name)
    except NativeUnavailable as exc:
        log.warning("%s unavailable, using PyTorch: %s", purpose, exc)
        return None
    for fn, argtypes in functions.items():
        getattr(lib, fn).restype = ctypes.c_int
        getattr(lib, fn).argtypes = argtypes
    return lib


def main() -> int:
    parser = argparse.ArgumentParser(description="build the native kernels ahead of use")
    parser.add_argument("--portable", action="store_true", help="x86-64-v3, for images")
    args = parser.parse_args()
    for source in sorted(SOURCE_DIR.glob("*.cpp")):
        try:
            print(build(source.stem, portable=args.portable))
        except NativeUnavailable as exc:
            # Not an error: the engine runs the PyTorch kernel and gloo collectives instead.
            print(f"{source.name} not built ({exc}); the PyTorch paths will be used")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
