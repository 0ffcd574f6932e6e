"""The test suite keeps its layout (docs/design.md §11): every test file sits in a kind's folder;
a unit test file below tests/unit/ mirrors the source, in the folder of the module it tests and
named after it (`test_<module>.py`, or `test_<module>_<aspect>.py` when one module's tests are
several files); the files at tests/unit/'s top check the whole repository, so none is named after
a module; and every folder of Python files is a package, so same-named files never collide."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import KINDS

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
UNIT = TESTS / "unit"
SOURCE_TOPS = ("common", "services", "tools")


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def _prefixes(stem: str) -> list[str]:
    """`test_worker_batching` -> ["worker_batching", "worker"]: the module names it may mean."""
    words = stem.removeprefix("test_").split("_")
    return ["_".join(words[:n]) for n in range(len(words), 0, -1)]


def _names_a_module_in(stem: str, folder: Path) -> bool:
    return any(
        (folder / f"{name}.py").is_file() or (folder / name).is_dir() for name in _prefixes(stem)
    )


def test_every_test_file_is_in_a_kind_folder() -> None:
    files = _test_files()
    assert len(files) > 50
    astray = [str(p.relative_to(ROOT)) for p in files if p.relative_to(TESTS).parts[0] not in KINDS]
    assert astray == [], f"test files outside tests/{{{','.join(KINDS)}}}/: {astray}"


def test_unit_tests_mirror_the_source() -> None:
    unnamed, repo_checks_named_after_a_module = [], []
    modules = {p.stem for top in SOURCE_TOPS for p in (ROOT / top).rglob("*.py")}
    for path in _test_files():
        if UNIT not in path.parents:
            continue
        folder = path.parent.relative_to(UNIT)
        if folder == Path("."):
            if any(name in modules for name in _prefixes(path.stem)):
                repo_checks_named_after_a_module.append(path.name)
        elif not _names_a_module_in(path.stem, ROOT / folder):
            unnamed.append(str(path.relative_to(ROOT)))
    assert unnamed == [], f"unit test files named after no module of their folder: {unnamed}"
    assert repo_checks_named_after_a_module == [], (
        "module tests at tests/unit/'s top (lay them out like the source): "
        f"{repo_checks_named_after_a_module}"
    )


def test_every_test_folder_is_a_package() -> None:
    folders = {p.parent for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts}
    missing = [
        str(f.relative_to(ROOT)) for f in sorted(folders) if not (f / "__init__.py").is_file()
    ]
    assert missing == [], f"folders of tests without an __init__.py: {missing}"


def test_a_stray_test_is_caught() -> None:
    # The naming rule itself, on the source tree as it is.
    assert _prefixes("test_worker_batching") == ["worker_batching", "worker"]
    assert _names_a_module_in("test_worker_batching", ROOT / "services" / "prefill")
    assert _names_a_module_in("test_demo", ROOT / "models")  # a folder, not a module
    assert not _names_a_module_in("test_tokenizer", ROOT / "common" / "kv")
