"""Kernel choice: the one rule by which every kernel selector picks what runs here.

A selector (the decode attention backend, prefill attention, the FP8 GEMM, the routed
experts' kernel) is asked, by its setting, for `auto` or a kernel by name (`KernelConfig`,
carried in each service's frozen config). Beside its kernels it says, for each one, why it
cannot run on this device in this dtype (None: it can), and which ones `auto` tries, best
first, the last a reference that runs anywhere. `choose_kernel` then decides, once, at
start-up:

- a kernel named explicitly that cannot run here is a `KernelUnavailable` naming the setting
  ("TPLA_DECODE_KERNEL=triton: triton is not installed"), raised while the service starts,
  never a silent fallback at first use;
- `auto` takes the first that can run, and the `KernelChoice` keeps why each better one
  could not.

The service logs each choice once (`log_choices`), names them in its start-up line
(`summary`) and exports them as labels of `tpla:kernel_info` (common/runtime/metrics.py).
Torch-free: the checks are the selectors' own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the kernels' modules import this one and never the settings
    from common.runtime.settings import Settings

log = logging.getLogger(__name__)

# Per selector: its setting and the kernels that setting may name (besides `auto`).
SELECTORS: dict[str, tuple[str, tuple[str, ...]]] = {
    "decode_attention": ("TPLA_DECODE_KERNEL", ("torch", "native", "triton")),
    "prefill_attention": ("TPLA_ATTENTION_BACKEND", ("sdpa", "native", "flash-attn")),
    "fp8_gemm": ("TPLA_FP8_GEMM", ("scaled_mm", "triton", "dequantize")),
    "experts": ("TPLA_EXPERTS_KERNEL", ("triton", "grouped", "loop")),
}

# Why a kernel cannot run here, or None where it can; called only when the rule asks.
Check = Callable[[], str | None]


class KernelUnavailable(ValueError):
    """A kernel asked for by name cannot run here: a configuration error, reported at
    start-up like every other."""


def setting_of(selector: str) -> str:
    """The setting that asks `selector` for its kernel (TPLA_DECODE_KERNEL, ...)."""
    return SELECTORS[selector][0]


def check_asked(selector: str, asked: str) -> None:
    """ValueError naming the setting unless `asked` is auto or one of the selector's
    kernels."""
    setting, kernels = SELECTORS[selector]
    if asked != "auto" and asked not in kernels:
        raise ValueError(f"{setting}={asked}: not one of auto, {', '.join(kernels)}")


@dataclass(frozen=True)
class KernelConfig:
    """What each selector was asked for (its setting's value): `auto` or a kernel by name."""

    decode_attention: str = "auto"
    prefill_attention: str = "auto"
    fp8_gemm: str = "auto"
    experts: str = "auto"

    def __post_init__(self) -> None:
        for selector in SELECTORS:
            check_asked(selector, getattr(self, selector))


def kernel_config(s: Settings) -> KernelConfig:
    """The kernels the settings ask for: the one mapping of the two."""
    return KernelConfig(
        decode_attention=s.decode_kernel,
        prefill_attention=s.attention_backend,
        fp8_gemm=s.fp8_gemm,
        experts=s.experts_kernel,
    )


@dataclass(frozen=True)
class KernelChoice:
    """What a selector runs here (`kernel`), what it was asked for (`asked`), and, where
    `auto` chose, each better kernel that could not run with why (`passed_over`)."""

    selector: str
    asked: str
    kernel: str
    passed_over: tuple[tuple[str, str], ...] = ()

    @property
    def setting(self) -> str:
        return setting_of(self.selector)

    def describe(self) -> str:
        """One line: the kernel, the setting's value and, under auto, why not the better."""
        why = "".join(f"; {name} cannot run here: {reason}" for name, reason in self.passed_over)
        return f"{self.selector} kernel: {self.kernel} ({self.setting}={self.asked}{why})"


def choose_kernel(
    selector: str, asked: str, checks: Mapping[str, Check], auto: Sequence[str]
) -> KernelChoice:
    """The rule. `checks`: every kernel the setting may name, with its check here; `auto`:
    the kernels `auto` tries on this device, best first, the last the reference.

    A named kernel is taken if its check passes, else `KernelUnavailable` naming the setting;
    `auto` takes the first whose check passes (KernelUnavailable if none does)."""
    check_asked(selector, asked)
    setting = setting_of(selector)
    if asked != "auto":
        why = checks[asked]()
        if why is not None:
            raise KernelUnavailable(f"{setting}={asked}: {why}")
        return KernelChoice(selector, asked, asked)
    passed: list[tuple[str, str]] = []
    for name in auto:
        why = checks[name]()
        if why is None:
            return KernelChoice(selector, asked, name, tuple(passed))
        passed.append((name, why))
    reasons = "; ".join(f"{name}: {why}" for name, why in passed)
    raise KernelUnavailable(f"{setting}=auto: no kernel can run here ({reasons})")


def log_choices(choices: Iterable[KernelChoice]) -> None:
    """Log each choice once, at start-up (with why `auto` passed over the better ones)."""
    for choice in choices:
        log.info("%s", choice.describe())


def summary(choices: Iterable[KernelChoice]) -> str:
    """`selector=kernel` for each choice, for a service's start-up line."""
    return ", ".join(f"{c.selector}={c.kernel}" for c in choices)
