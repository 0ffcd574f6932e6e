"""Counting the host waits of a stretch of code: every op that makes the host wait for the
device.

On a GPU such an op blocks the CPU until the device has caught up, which stalls the launch
queue and rules out capturing the step in a CUDA graph. On the CPU nothing waits, so the same
code paths are counted instead. `HostSyncCounter` counts, inside it:

- at the dispatcher (a `TorchDispatchMode`), every op that reads a value on the host or
  sizes its result by the values of its input (`SYNC_OPS`): `item` / `_local_scalar_dense`
  (`.item()`, `int(t)`, `float(t)`, `bool(t)`, `if t:`), `is_nonzero`, `nonzero`
  (`torch.where(c)`, `argwhere`, as inference mode dispatches them too), `masked_select`,
  `equal`, `allclose`, `unique` (all its forms), `bincount`; `index` and `index_put_` by a
  boolean mask (`t[mask]`, `t[mask] = v`); `repeat_interleave` without `output_size`;
  `masked_fill` with a tensor value on the tensor's device (read on the host);
- by wrapping, what reads without dispatching an op: `Tensor.tolist`, `Tensor.numpy`,
  `Tensor.item` (once, not again for the op it dispatches), and device -> host copies:
  `Tensor.cpu()` and a blocking `Tensor.to` onto the CPU. `.to("cpu")` of a CPU tensor
  dispatches nothing, so the rule is what the same call does on a GPU: a blocking copy to the
  host waits; a `non_blocking=True` one (into pinned memory, read after an awaited event)
  does not. So a host tensor is put on the step's device by `common.runtime.transfers`
  (which leaves it as it is on the CPU), never by `.to(device)`, which on the CPU would read
  as a copy to the host. A `copy_` between CPU tensors is device work: on a GPU it is a copy
  on the device (the step's device -> host copies go through `common.runtime.transfers`).

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

aten = torch.ops.aten
# `item` is what inference mode dispatches where `_local_scalar_dense` appears otherwise.
SYNC_OPS = frozenset(
    {
        aten._local_scalar_dense.default,
        aten.item.default,
        aten.is_nonzero.default,
        aten.nonzero.default,
        aten.nonzero_numpy.default,
        aten.argwhere.default,
        aten.where.default,  # where(condition): the nonzero of its condition
        aten.masked_select.default,
        aten.equal.default,
        aten.allclose.default,
        aten._unique.default,
        aten._unique2.default,
        aten.unique_dim.default,
        aten.unique_consecutive.default,
        aten.bincount.default,
    }
)
# Synchronizing only for some arguments: a boolean mask, no output size, a tensor value.
_MASK_INDEXED = frozenset({aten.index.Tensor, aten.index_put_.default, aten.index_put.default})
_REPEAT = frozenset({aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor})
_FILL = aten.masked_fill.Tensor
_CPU = torch.device("cpu")

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


def _wrap_to(method: Callable[..., Any]) -> Callable[..., Any]:
    """`Tensor.to`, counted where it is a blocking copy onto the host."""
    counted = _wrap(method)

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _to_host(self, args, kwargs):
            return counted(self, *args, **kwargs)
        return method(self, *args, **kwargs)

    to.__name__, to.__doc__ = method.__name__, method.__doc__
    return to


def _to_host(t: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether `t.to(*args, **kwargs)` is a blocking copy onto the CPU (see above)."""
    if not _counters() or _state.quiet:
        return False
    device = kwargs.get("device")
    for arg in args:
        if isinstance(arg, str | torch.device):
            device = arg
        elif isinstance(arg, torch.Tensor):
            device = arg.device
    if device is None or torch.device(device) != _CPU:
        return False
    blocking_args = [a for a in args if isinstance(a, bool)]
    non_blocking = kwargs.get("non_blocking", blocking_args[0] if blocking_args else False)
    return not non_blocking


def _install() -> None:
    """Wrap the methods that read or copy to the host without an op of their own, once per
    process (a wrapper that counts only inside a counter, on the thread that opened it)."""
    global _installed
    with _install_lock:
        if not _installed:
            tensor = torch.Tensor
            tensor.tolist = _wrap(tensor.tolist)  # type: ignore[method-assign]
            tensor.item = _wrap(tensor.item)  # type: ignore[method-assign]
            tensor.numpy = _wrap(tensor.numpy)  # type: ignore[method-assign]
            tensor.cpu = _wrap(tensor.cpu)  # type: ignore[method-assign]
            tensor.to = _wrap_to(tensor.to)  # type: ignore[method-assign]
            _installed = True


class _Mode(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if not _state.quiet and _synchronizes(func, args, kwargs):
            self.counter.count += 1
        return func(*args, **kwargs)


def _synchronizes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if func in SYNC_OPS:
        return True
    if func in _MASK_INDEXED:
        indices = args[1] if len(args) > 1 else ()
        return any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
        )
    if func in _REPEAT:
        return kwargs.get("output_size") is None
    if func is _FILL:
        value = args[2] if len(args) > 2 else kwargs.get("value")
        return isinstance(value, torch.Tensor) and value.device == args[0].device
    return False


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
