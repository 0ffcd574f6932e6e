"""How this process runs Triton kernels: compiled (CUDA tensors, or ahead of time) or by
Triton's interpreter (CPU tensors), and whether it can at all.

Triton builds its own library functions (tl.max, tl.sum, tl.cdiv, ...) for one mode when it
is first imported: a process runs Triton kernels interpreted or compiled, never both. The
kernels of this package are plain functions, wrapped when first launched in the mode that
triton was imported in (`wrap`). Nothing here imports triton until asked to, so a process
checks where a kernel could run (`unsupported`) without loading it; a kernel's own module
imports triton, and is imported only where its kernel runs.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch


@functools.cache
def triton_installed() -> bool:
    """Whether triton can be imported here (says nothing about a GPU); imports nothing."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton's interpreter is switched on (TRITON_INTERPRET, read at every call)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def available() -> bool:
    """Whether a kernel can run here: triton importable, and CUDA or the interpreter."""
    return triton_installed() and (torch.cuda.is_available() or interpreting())


def interpreted_import() -> bool:
    """Whether triton was (or, imported now, is) first imported under TRITON_INTERPRET=1 in
    this process."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.cdiv, InterpretedFunction)


def wrap(fn: Callable[..., Any], do_not_specialize: tuple[str, ...] = ()) -> Any:
    """`fn` as this process's mode runs it: an `InterpretedFunction` (CPU tensors) if triton
    was imported under TRITON_INTERPRET=1, else a `JITFunction` (CUDA, AOT)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    kind = InterpretedFunction if interpreted_import() else JITFunction
    return kind(fn, do_not_specialize=do_not_specialize)


def unsupported(
    device: torch.device, min_capability: tuple[int, int] = (0, 0), needs: str = ""
) -> str | None:
    """Why a Triton kernel cannot run on `device` here (`needs`: what a GPU below
    `min_capability` lacks), or None where it can; imports no triton."""
    if not triton_installed():
        return "triton is not installed (pip install triton)"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA device here"
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < min_capability:
            want = "".join(map(str, min_capability))
            return f"sm_{major}{minor}: {needs} need sm_{want} or newer"
        return None
    if device.type == "cpu" and interpreting():
        return None
    return "Triton kernels run on CUDA devices, or on the CPU under TRITON_INTERPRET=1"


def check_runnable(device: torch.device, what: str) -> None:
    """`what` (a kernel, "the Triton decode kernel") can run on `device` in this process
    (compiled on CUDA, or interpreted on the CPU), else the error that says why."""
    if not triton_installed():
        raise RuntimeError(f"{what} needs triton (pip install triton)")
    cuda = device.type == "cuda"
    if not cuda and not interpreting():
        raise ValueError(
            f"{what} runs on CUDA tensors, not {device} "
            "(set TRITON_INTERPRET=1 to run Triton's interpreter on the CPU)"
        )
    if cuda == interpreted_import():
        raise RuntimeError(
            "triton was imported under TRITON_INTERPRET=1, so this process cannot run compiled "
            "kernels on CUDA tensors"
            if cuda
            else "Triton's interpreter needs TRITON_INTERPRET=1 set before triton is first "
            "imported in the process"
        )
