"""The layering holds: common/ is the library the services share, services/ build on it, and
tools/ (the CLI, benchmarks, the demo trainer) sit on top; and no modules import each other in
a cycle. Every import statement under common/, services/ and tools/ is read with `ast` (lazy
imports inside functions and those under TYPE_CHECKING included)."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("common", "services", "tools")

# (importer prefix, imported prefix): no module under the first may import one under the second.
FORBIDDEN: tuple[tuple[str, str], ...] = (
    ("common", "services"),
    ("common", "tools"),
    ("services", "tools"),
    ("common.native", "common.model"),
    # Kernels receive their choice from the config (common/runtime/kernel_choice.py).
    ("common.model", "common.runtime.settings"),
    ("services.decode.rank.backends", "common.runtime.settings"),
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


def _sources() -> list[Path]:
    return [
        path
        for top in TOPS
        for path in sorted((ROOT / top).rglob("*.py"))
        if "gen" not in path.relative_to(ROOT).parts  # generated gRPC stubs
    ]


def edges() -> list[tuple[str, str]]:
    """(importer, imported) for every import of every module: the imported name as written,
    a module or `module.name`."""
    out = []
    for path in _sources():
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


def graph(pairs: Iterable[tuple[str, str]], modules: set[str]) -> dict[str, set[str]]:
    """The module graph: each imported name resolved to the module it loads (the longest of
    `modules` it starts with), imports of other packages and of itself dropped."""
    out: dict[str, set[str]] = {}
    for src, name in pairs:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != src:
            out.setdefault(src, set()).add(name)
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without
    recursion): each is a set of modules that import each other, directly or around a ring."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(g.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(found)


def _describe(component: list[str], g: dict[str, set[str]]) -> str:
    inside = [
        f"    {src} imports {dst}"
        for src in component
        for dst in sorted(g.get(src, ()))
        if dst in component
    ]
    return f"cycle of {len(component)} modules:\n" + "\n".join(inside)


def test_no_import_cycle() -> None:
    g = graph(edges(), {_module(path) for path in _sources()})
    found = cycles(g)
    assert found == [], "import cycles (TYPE_CHECKING imports count):\n" + "\n".join(
        _describe(c, g) for c in found
    )


def test_a_cycle_is_caught() -> None:
    # The checker itself: an import under TYPE_CHECKING is an edge, `from package import
    # module` loads the module, and a ring of three is one cycle; a chain is none.
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from common.b import B\n"
    assert "common.b.B" in _imports(typed, "common")
    modules = {"common.a", "common.b", "common.c", "common.d", "common"}
    pairs = [
        ("common.a", "common.b.B"),
        ("common.b", "common.c"),
        ("common.c", "common.a"),
        ("common.c", "common.d.f"),
        ("common.d", "typing"),
    ]
    g = graph(pairs, modules)
    assert cycles(g) == [["common.a", "common.b", "common.c"]]
    assert _describe(cycles(g)[0], g).splitlines()[1:] == [
        "    common.a imports common.b",
        "    common.b imports common.c",
        "    common.c imports common.a",
    ]
    assert cycles(graph(pairs[1:], modules)) == []
