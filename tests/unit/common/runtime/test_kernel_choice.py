"""The one kernel-choice rule (common/runtime/kernel_choice.py): a named kernel that cannot
run is an error naming the setting, `auto` takes the best that can and keeps why not the
better ones, every setting's value is checked against its selector's kernels, and the choices
are exported as `tpla:kernel_info` labels."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from common.runtime.kernel_choice import (
    SELECTORS,
    KernelChoice,
    KernelConfig,
    KernelUnavailable,
    choose_kernel,
    kernel_config,
    log_choices,
    summary,
)
from common.runtime.metrics import kernel_info
from common.runtime.settings import Settings

# A stand-in selector's checks: triton cannot run here, native and torch can.
CHECKS = {
    "triton": lambda: "no GPU here",
    "native": lambda: None,
    "torch": lambda: None,
}


def test_a_named_kernel_that_cannot_run_is_an_error_naming_the_setting() -> None:
    with pytest.raises(KernelUnavailable, match=r"^TPLA_DECODE_KERNEL=triton: no GPU here$"):
        choose_kernel("decode_attention", "triton", CHECKS, ("triton", "torch"))
    assert issubclass(KernelUnavailable, ValueError)  # the CLI prints it and exits 2
    named = choose_kernel("decode_attention", "native", CHECKS, ("triton", "torch"))
    assert (named.kernel, named.asked, named.passed_over) == ("native", "native", ())


def test_auto_takes_the_best_that_can_run_and_says_why_not_the_better() -> None:
    auto = choose_kernel("decode_attention", "auto", CHECKS, ("triton", "native", "torch"))
    assert auto.kernel == "native" and auto.passed_over == (("triton", "no GPU here"),)
    assert auto.setting == "TPLA_DECODE_KERNEL"
    assert auto.describe() == (
        "decode_attention kernel: native (TPLA_DECODE_KERNEL=auto; triton cannot run here: "
        "no GPU here)"
    )
    first = choose_kernel("decode_attention", "auto", CHECKS, ("native", "torch"))
    assert first.passed_over == () and first.describe().endswith("(TPLA_DECODE_KERNEL=auto)")


def test_auto_where_nothing_runs_is_an_error() -> None:
    with pytest.raises(KernelUnavailable, match=r"TPLA_FP8_GEMM=auto: .*scaled_mm: old GPU"):
        choose_kernel(
            "fp8_gemm",
            "auto",
            {"scaled_mm": lambda: "old GPU", "dequantize": lambda: "broken"},
            ("scaled_mm", "dequantize"),
        )


def test_only_the_checks_the_rule_needs_are_asked() -> None:
    asked: list[str] = []

    def check(name: str) -> str | None:
        asked.append(name)
        return None

    checks = {name: (lambda name=name: check(name)) for name in ("grouped", "loop")}
    choose_kernel("experts", "auto", checks, ("grouped", "loop"))
    choose_kernel("experts", "loop", checks, ("grouped", "loop"))
    assert asked == ["grouped", "loop"]  # a check may build a library: never one not needed


def test_every_setting_value_is_checked_against_its_selector() -> None:
    assert KernelConfig() == KernelConfig("auto", "auto", "auto", "auto")
    with pytest.raises(ValueError, match=r"^TPLA_EXPERTS_KERNEL=fast: not one of auto, triton,"):
        KernelConfig(experts="fast")
    with pytest.raises(ValueError, match=r"^TPLA_ATTENTION_BACKEND=flash: not one of"):
        choose_kernel("prefill_attention", "flash", {}, ())
    assert set(SELECTORS) == set(KernelConfig.__dataclass_fields__)


def test_the_settings_map_onto_the_config() -> None:
    s = Settings(
        decode_kernel="torch",
        attention_backend="sdpa",
        fp8_gemm="dequantize",
        experts_kernel="loop",
    )
    assert kernel_config(s) == KernelConfig("torch", "sdpa", "dequantize", "loop")
    assert kernel_config(Settings()) == KernelConfig()


def test_the_choices_go_to_the_log_the_start_up_line_and_the_info_metric(
    caplog: pytest.LogCaptureFixture,
) -> None:
    choices = [
        KernelChoice("decode_attention", "auto", "native"),
        KernelChoice("fp8_gemm", "auto", "dequantize", (("scaled_mm", "cpu device"),)),
    ]
    with caplog.at_level(logging.INFO, logger="common.runtime.kernel_choice"):
        log_choices(choices)
    assert [r.getMessage() for r in caplog.records] == [c.describe() for c in choices]
    assert summary(choices) == "decode_attention=native, fp8_gemm=dequantize"
    registry = CollectorRegistry()
    kernel_info(registry, choices)
    text = generate_latest(registry).decode()
    assert 'tpla:kernel_info{kernel="native",selector="decode_attention"} 1.0' in text
    assert 'tpla:kernel_info{kernel="dequantize",selector="fp8_gemm"} 1.0' in text
