"""How this process runs Triton kernels: compiled (CUDA tensors, or ahead of time) or by
Triton's interpreter (CPU tensors), and whether it can at all.

Triton builds its own library functions (tl.max, tl.sum, tl.cdiv, ...) for one mode when it
is first imported: a process runs Triton kernels interpreted or compiled, never both. The
kernels of this package are plain functions, wrapped when first launched in the mode that
triton was imported in (`wrap`), so importing them never needs triton or a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

try:  # A CPU deployment without triton imports this module and never launches a kernel.
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    tl = None


def triton_installed() -> bool:
    """Whether triton can be imported here (says nothing about a GPU)."""
    return tl is not None


def interpreting() -> bool:
    """Whether Triton's interpreter is switched on (TRITON_INTERPRET, read at every call)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def available() -> bool:
    """Whether a kernel can run here: triton importable, and CUDA or the interpreter."""
    return triton_installed() and (torch.cuda.is_available() or interpreting())


def interpreted_import() -> bool:
    """Whether triton was first imported under TRITON_INTERPRET=1 in this process."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.cdiv, InterpretedFunction)


def wrap(fn: Callable[..., Any], do_not_specialize: tuple[str, ...] = ()) -> Any:
    """`fn` as this process's mode runs it: an `InterpretedFunction` (CPU tensors) if triton
    was imported under TRITON_INTERPRET=1, else a `JITFunction` (CUDA, AOT)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    kind = InterpretedFunction if interpreted_import() else JITFunction
    return kind(fn, do_not_specialize=do_not_specialize)


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
