"""The layering holds: common/ is the library the services share, services/ build on it, and
tools/ (the CLI, benchmarks, the demo trainer) sit on top; no modules import each other in
a cycle; and no two siblings of the tree (two folders of one folder, or a folder and a module
beside it) import each other, even without a module cycle: such a tie means a concept both
need lives in the wrong one, and should move down. Every import statement under common/,
services/ and tools/ is read with `ast` (lazy imports inside functions and those under
TYPE_CHECKING included)."""

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


def siblings(importer: str, imported: str) -> tuple[str, str] | None:
    """The two siblings of the tree an import runs between: the two names down to the first
    part where they differ (`services.decode.group.spec` importing `services.decode.config`:
    `services.decode.group` and `services.decode.config`); None when one contains the other."""
    a, b = importer.split("."), imported.split(".")
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    if common in (len(a), len(b)):
        return None
    return ".".join(a[: common + 1]), ".".join(b[: common + 1])


def ties(g: dict[str, set[str]]) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """Each pair of siblings that import each other, with the module imports each way."""
    between: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for src, names in g.items():
        for dst in names:
            pair = siblings(src, dst)
            if pair is not None:
                between.setdefault(pair, []).append((src, dst))
    return {
        (a, b): sorted(between[a, b] + between[b, a])
        for a, b in sorted(between)
        if a < b and (b, a) in between
    }


def test_no_two_siblings_import_each_other() -> None:
    g = graph(edges(), {_module(path) for path in _sources()})
    found = ties(g)
    assert found == {}, "two-way ties:\n" + "\n".join(
        f"  {a} <-> {b}: " + ", ".join(f"{s} imports {d}" for s, d in imports)
        for (a, b), imports in found.items()
    )


def test_a_tie_is_caught() -> None:
    # A folder and a module beside it, each importing the other, is a tie; so are two
    # folders; a package importing its own modules is none.
    g = {
        "common.parallel": {"common.model.args"},
        "common.model.tpla": {"common.parallel"},
        "services.decode.group.start": {"services.decode.rank.runtime"},
        "services.decode.rank.graphs": {"services.decode.group.spec"},
        "services.decode": {"services.decode.config"},
        "services.decode.config": {"services.decode.leader.drafts"},
    }
    assert siblings("services.decode", "services.decode.config") is None
    assert list(ties(g)) == [
        ("common.model", "common.parallel"),
        ("services.decode.group", "services.decode.rank"),
    ]
