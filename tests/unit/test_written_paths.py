"""Paths written as strings lead somewhere: every `python -m X` in the repository (code, docs,
Makefile, Dockerfiles, scripts, manifests) names a runnable module, every `python -c "import X"`
and every dotted project module a Python file names in a string (a spawned follower, the soak
run's process matching) names a module, and every `tests/...` path cited names a file or folder.
The project's modules are looked up as files, so nothing is imported."""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("common", "services", "tools")
SKIP_DIRS = {".git", ".venv", ".pytest_cache", ".hypothesis", ".ruff_cache", "__pycache__"}
TEXT_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".cpp", ".h"}
TEXT_NAMES = {"Makefile", "run"}  # run: .ci/run
# Names here are examples of what is not a module: this file, and the import-graph test's
# made-up importer.
NOT_SCANNED = {Path(__file__).resolve(), ROOT / "tests" / "unit" / "test_import_graph.py"}

RUN_MODULE = re.compile(r"python[\w.]*\)?\s+(?:-[A-Za-z]+\s+)*-m\s+([A-Za-z_][\w.]*)", re.I)
IMPORT_CHECK = re.compile(r"python[\w.]*\s+-c\s+[\"']\s*import\s+([\w., ]+)")
PROJECT_MODULE = re.compile(rf"^(?:{'|'.join(PROJECT)})(?:\.[A-Za-z_]\w*)+$")
TEST_PATH = re.compile(r"(?<![\w/.-])tests/[\w./-]*\w")


@functools.cache
def _text_files() -> tuple[Path, ...]:
    found = []
    for folder, dirs, files in os.walk(ROOT):
        # Pruned here, not filtered after: a venv in the checkout holds thousands of files.
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        if Path(folder).name == "gen":  # the generated gRPC stubs
            continue
        for name in sorted(files):
            path = Path(folder) / name
            named = name in TEXT_NAMES or name.startswith("Dockerfile")
            if (named or path.suffix in TEXT_SUFFIXES) and path.resolve() not in NOT_SCANNED:
                found.append(path)
    return tuple(found)


def _is_module(name: str, *, runnable: bool) -> bool:
    """`name` is a module (`runnable`: one `python -m` can run, so a package needs __main__)."""
    parts = name.split(".")
    if parts[0] in PROJECT or (ROOT / parts[0] / "__init__.py").is_file():
        path = ROOT.joinpath(*parts)
        if path.with_suffix(".py").is_file():
            return True
        return (path / ("__main__.py" if runnable else "__init__.py")).is_file()
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _source_references(source: str) -> Iterator[tuple[int, str, bool]]:
    """In Python source: `[..., "-m", "X", ...]`, a module a subprocess runs, and every string
    that is a dotted path under the project's packages."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.List | ast.Tuple):
            for flag, arg in zip(node.elts, node.elts[1:], strict=False):
                if (
                    isinstance(flag, ast.Constant)
                    and flag.value == "-m"
                    and isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str)
                ):
                    yield arg.lineno, arg.value, True
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and PROJECT_MODULE.match(node.value)
        ):
            yield node.lineno, node.value, False


def references(text: str, *, python: bool) -> Iterator[tuple[int, str, bool]]:
    """(line, module, runnable) for every module path `text` writes down (`python`: source)."""
    for match in RUN_MODULE.finditer(text):
        yield text.count("\n", 0, match.start()) + 1, match.group(1).rstrip("."), True
    for match in IMPORT_CHECK.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        for name in (n.strip() for n in match.group(1).split(",")):
            if name.split(".")[0] in PROJECT:
                yield line, name, False
    if python:
        yield from _source_references(text)


@functools.cache
def _all_references() -> tuple[tuple[str, int, str, bool], ...]:
    return tuple(
        (str(path.relative_to(ROOT)), line, name, runnable)
        for path in _text_files()
        for line, name, runnable in references(
            path.read_text(encoding="utf-8"), python=path.suffix == ".py"
        )
    )


def test_the_references_are_found() -> None:
    found = _all_references()
    files = {file for file, *_ in found}
    assert {"Makefile", "docker/Dockerfile", "loadtest/soak.py"} <= files
    assert any(file.startswith("services/") and runnable for file, _, _, runnable in found)


def test_every_module_path_written_down_exists() -> None:
    missing = [
        f"{file}:{line}: {'python -m ' if runnable else ''}{name}"
        for file, line, name, runnable in _all_references()
        if not _is_module(name, runnable=runnable)
    ]
    assert missing == [], "module paths that name no module:\n" + "\n".join(missing)


def test_every_test_path_written_down_exists() -> None:
    missing = [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}: {match.group()}"
        for path in _text_files()
        for text in [path.read_text(encoding="utf-8")]
        for match in TEST_PATH.finditer(text)
        if not (ROOT / match.group().rstrip(".")).exists()
    ]
    assert missing == [], "test paths that name nothing:\n" + "\n".join(missing)


def test_a_missing_module_is_caught() -> None:
    # The scanner itself: each form is seen, and only real modules pass.
    source = (
        'SPAWN = [sys.executable, "-m", "services.nowhere.runtime"]\n'
        'MATCH = "common.nowhere"\n'
        '"""Run `python -m tools.cli` or `python3 -u -m venv`."""\n'
    )
    found = {(name, runnable) for _, name, runnable in references(source, python=True)}
    assert found == {
        ("tools.cli", True),
        ("venv", True),
        ("services.nowhere.runtime", True),  # what the list runs
        ("services.nowhere.runtime", False),  # and a project module written as a string
        ("common.nowhere", False),
    }
    assert {name for name, runnable in found if not _is_module(name, runnable=runnable)} == {
        "services.nowhere.runtime",
        "common.nowhere",
    }
    assert not _is_module("common.native", runnable=True)  # a package without __main__
    assert _is_module("tools.cli", runnable=True) and _is_module("common.native", runnable=False)
    assert [m.group() for m in TEST_PATH.finditer("see tests/unit/x.py. and tests/e2e/")] == [
        "tests/unit/x.py",
        "tests/e2e",
    ]
