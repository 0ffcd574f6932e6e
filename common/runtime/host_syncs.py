"""Counting the host waits of a stretch of code: every read of a tensor's value on the host.

On a GPU such a read (`.item()`, `.tolist()`, `int(t)`, `bool(t)`, a `nonzero` whose size the
host must learn) blocks the CPU until the device has caught up, which stalls the launch queue
and rules out capturing the step in a CUDA graph. On the CPU nothing waits, so the same code
paths are counted instead: `HostSyncCounter` sees `aten._local_scalar_dense` (`aten.item`
under inference mode), `aten.nonzero`, `aten.is_nonzero` and the ops whose result size a mask's
values decide (`masked_select`, indexing by a boolean mask) through a `TorchDispatchMode`, plus
`Tensor.tolist` and `Tensor.item` (wrapped: `tolist` reads values without dispatching an op).

What runs inside a counter is taken to be device work. Host-side bookkeeping that stays on the
host on a GPU (a plan built from Python lists, the sampled results once their one awaited copy
has landed in pinned memory) runs under `host_side()`, which counts nothing; the awaited copy
itself is counted once with `note_wait()`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# `item` is what inference mode dispatches where `_local_scalar_dense` appears otherwise;
# `masked_select` and indexing with a boolean mask size their result from the mask's values.
_SYNC_OPS = frozenset(
    {
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.item.default,
        torch.ops.aten.nonzero.default,
        torch.ops.aten.is_nonzero.default,
        torch.ops.aten.masked_select.default,
    }
)
_INDEX = torch.ops.aten.index.Tensor

_state = threading.local()  # .counters: the active counters; .quiet: counting suspended
_install_lock = threading.Lock()
_installed = False


def _counters() -> list[HostSyncCounter]:
    if not hasattr(_state, "counters"):
        _state.counters, _state.quiet = [], 0
    return _state.counters


def _wrap(method: Callable[..., Any]) -> Callable[..., Any]:
    def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counters = _counters()
        if not counters or _state.quiet:
            return method(self, *args, **kwargs)
        for counter in counters:
            counter.count += 1
        _state.quiet += 1  # `.item()` dispatches _local_scalar_dense: one read, counted once
        try:
            return method(self, *args, **kwargs)
        finally:
            _state.quiet -= 1

    counted.__name__ = method.__name__
    counted.__doc__ = method.__doc__
    return counted


def _install() -> None:
    """Wrap `Tensor.tolist` / `Tensor.item` once per process (a wrapper that counts only
    inside a counter, on the thread that opened it)."""
    global _installed
    with _install_lock:
        if not _installed:
            torch.Tensor.tolist = _wrap(torch.Tensor.tolist)  # type: ignore[method-assign]
            torch.Tensor.item = _wrap(torch.Tensor.item)  # type: ignore[method-assign]
            _installed = True


class _Mode(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if not _state.quiet and (func in _SYNC_OPS or (func is _INDEX and _by_mask(args))):
            self.counter.count += 1
        return func(*args, **(kwargs or {}))


def _by_mask(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    )


class HostSyncCounter:
    """`with HostSyncCounter() as c: ...` then `c.count`: the host waits the block made.

    Counters nest (each counts everything inside it) and are per thread."""

    def __init__(self) -> None:
        self.count = 0
        self._mode: _Mode | None = None

    def __enter__(self) -> HostSyncCounter:
        _install()
        _counters().append(self)
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        _counters().remove(self)


def note_wait() -> None:
    """Count one wait that no op shows on the CPU: the event-awaited copy of a step's results
    into pinned host memory (a plain copy on the CPU)."""
    for counter in _counters():
        counter.count += 1


@contextmanager
def host_side() -> Iterator[None]:
    """Code that reads only host tensors (it stays on the host on a GPU): not counted."""
    _counters()
    _state.quiet += 1
    try:
        yield
    finally:
        _state.quiet -= 1
