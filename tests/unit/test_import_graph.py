"""The layering holds: common/ is the library the services share, services/ build on it, and
tools/ (the CLI, benchmarks, the demo trainer) sit on top. Every import statement under
common/ and services/ is read with `ast` (lazy imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (importer prefix, imported prefix): no module under the first may import one under the second.
FORBIDDEN: tuple[tuple[str, str], ...] = (
    ("common", "services"),
    ("common", "tools"),
    ("services", "tools"),
    ("common.native", "common.model"),
)


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(source: str, package: str) -> set[str]:
    """Every module (and `module.name`) that `source`, a module of `package`, imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing package
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def edges() -> list[tuple[str, str]]:
    out = []
    for top in ("common", "services"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "gen" in path.relative_to(ROOT).parts:  # generated gRPC stubs
                continue
            module = _module(path)
            package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            imported = _imports(path.read_text(), package)
            out += [(module, name) for name in sorted(imported)]
    return out


def test_the_sources_are_found() -> None:
    importers = {src for src, _ in edges()}
    assert "common.runtime.settings" in importers
    assert "services.decode.engine" in importers
    assert ("services.stack.serve", "common.runtime.ports") in edges()


def _violations(pairs: list[tuple[str, str]]) -> list[str]:
    return [
        f"{src} imports {dst}"
        for src, dst in pairs
        for low, high in FORBIDDEN
        if _under(src, low) and _under(dst, high)
    ]


def test_no_import_points_up_the_layers() -> None:
    assert _violations(edges()) == []


def test_an_upward_import_is_caught() -> None:
    # The checker itself: lazy imports inside functions and relative imports are seen.
    source = "def f():\n    from tools.cli.main import main\n    from ..model import mla\n"
    imported = _imports(source, "common.native")
    assert {"tools.cli.main", "common.model.mla"} <= imported
    pairs = [("common.native.probe", name) for name in imported]
    assert sorted(_violations(pairs)) == [
        "common.native.probe imports common.model",
        "common.native.probe imports common.model.mla",
        "common.native.probe imports tools.cli.main",
        "common.native.probe imports tools.cli.main.main",
    ]
