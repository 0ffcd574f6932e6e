"""No file in common/ or services/ is over 450 lines (the generated gRPC stubs aside): a module
that outgrows it does more than one thing and is split (docs/design.md §11)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 450
SOURCE_SUFFIXES = {".py", ".cpp", ".h"}


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_source_file_is_over_the_limit() -> None:
    sizes = {
        str(path.relative_to(ROOT)): _lines(path)
        for top in ("common", "services")
        for path in sorted((ROOT / top).rglob("*"))
        if path.suffix in SOURCE_SUFFIXES and "gen" not in path.relative_to(ROOT).parts
    }
    assert len(sizes) > 50  # the walk found the sources
    over = {name: n for name, n in sizes.items() if n > LIMIT}
    assert over == {}, f"files over {LIMIT} lines: {over}"
