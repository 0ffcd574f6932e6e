"""A checkpoint as downloaded (the demo without its tpla_*.json side files) serves: `tpla serve
--smoke` answers with the identity basis and says so once; `TPLA_REPARAM=none` serves it on a
prefill group of two ranks without a word; a side file named but missing stops the stack before
anything starts, naming the file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tools.local_stack import LocalStack

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"
SMOKE_TIMEOUT_S = 300
WARNING = "no TPLA side file"


@pytest.fixture(scope="module")
def downloaded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("downloaded") / "demo"
    shutil.copytree(DEMO, out, ignore=shutil.ignore_patterns("tpla_*.json"))
    return out


def _smoke(model: Path, **settings: str) -> tuple[int, str]:
    """`tpla serve --smoke`: its exit code and everything it (and every service) printed."""
    stack = LocalStack.launch(model, "--smoke", KV_BUDGET_MB="8", **settings)
    try:
        code = stack.proc.wait(timeout=SMOKE_TIMEOUT_S)
    finally:
        stack.stop()
    return code, stack.log()


def _answered(log: str) -> bool:
    return '"chat.completion"' in log and '"finish_reason"' in log


def test_serves_with_the_identity_basis_and_one_warning(downloaded: Path) -> None:
    code, log = _smoke(downloaded)
    assert code == 0 and _answered(log), log[-4000:]
    assert log.count(WARNING) == 1, log[-4000:]
    assert str(downloaded / "tpla_pca.json") in log


def test_reparam_none_on_a_prefill_group(downloaded: Path) -> None:
    code, log = _smoke(downloaded, REPARAM="none", PREFILL_TP="2")
    assert code == 0 and _answered(log), log[-4000:]
    assert WARNING not in log and "none.json" not in log and "Errno" not in log, log[-4000:]


def test_a_named_side_file_that_is_missing_is_a_start_up_error(downloaded: Path) -> None:
    code, log = _smoke(downloaded, REPARAM="tpla_hadamard")
    assert code == 2, log[-4000:]
    assert f"the side file {downloaded / 'tpla_hadamard.json'} does not exist" in log
    assert "embedded redis-server" not in log  # refused before anything started
