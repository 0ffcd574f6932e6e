"""Shared fixtures, and each test's kind marked from its folder (docs/design.md §11). Every test
process runs torch single-threaded: CI has two cores and several test processes (servers,
ranks) may share them."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from tests.tiny import save_tiny_chat_model

torch.set_num_threads(1)

TESTS = Path(__file__).parent
# A test's kind is the folder under tests/ that holds it; these are the markers each kind gets
# (registered in pyproject.toml), so that `pytest -m KIND` and the Makefile select by kind.
KINDS: dict[str, tuple[str, ...]] = {
    "unit": ("unit",),
    "integration": ("integration",),
    "e2e": ("e2e", "slow"),
    "fault": ("fault", "slow"),
    "gpu": ("gpu",),
    "deploy": ("deploy", "slow"),
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks every test with its folder's kind; a test outside the kind folders is an error."""
    for item in items:
        kind = item.path.relative_to(TESTS).parts[0]
        if kind not in KINDS:
            raise pytest.UsageError(
                f"{item.nodeid}: a test belongs in one of tests/{{{','.join(KINDS)}}}/"
            )
        for marker in KINDS[kind]:
            item.add_marker(marker)


def _import_triton_in_this_machines_mode() -> None:
    """A process runs Triton either interpreted or compiled, fixed by TRITON_INTERPRET at
    triton's first import. Without CUDA the tests run Triton's interpreter, so triton is first
    imported here under TRITON_INTERPRET=1, which is removed again at once: no subprocess a
    test starts inherits it (where it would put the engine's ranks on the interpreter). With
    CUDA the same tests run the compiled kernels."""
    if torch.cuda.is_available():
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except ImportError:
        pass  # no triton: the Triton tests skip
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


_import_triton_in_this_machines_mode()


@pytest.fixture
def triton_interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's launchers read TRITON_INTERPRET at every call: set it for one test (without
    CUDA), as it was at triton's import."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V2 checkpoint with a tokenizer (d_c = 32, 4 heads, 3 layers), shared by
    the TPLA unit tests and the `tpla` CLI's."""
    return save_tiny_chat_model(tmp_path_factory.mktemp("tpla-tiny"), std=0.05)
