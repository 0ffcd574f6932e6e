"""Where a layout lives: code that asks which layout or MoE mode a group runs stays in the
few modules `LAYOUT_MODULES` names (docs/design.md §4, "What a new layout or MoE mode
touches"); everywhere else asks the layout (`ParallelConfig`) what it means for a rank.
Every source under common/, services/, tools/, loadtest/ and docker/ is read with `ast`.

What counts as asking: the old `.sp` flag; a member of `ParallelMode` or `MoeParallel`
(comparing with one, building a layout from one, keying on one), except a field's or a
parameter's default and a name read as a string (`.value`: a benchmark names the layouts it
measures); a comparison with a layout's name as a string ("mla-tp", "sp"; "tpla" also names
the project and the oracle's mode, so it cannot be told apart); `chunk_size is None` (the
old way of saying "not SP"); importing SP's chunk arithmetic, which exists only as the
layout's methods. And "mla-tp" is spelled once, where the layouts are named.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("common", "services", "tools", "loadtest", "docker")

LAYOUT_MODULES = (
    "common/parallel.py",  # the names, their parser, every rank's slices and tokens
    "services/decode/rank/cache_split.py",  # a decode rank's step, one CacheSplit a layout
)
MODE_ENUMS = frozenset({"ParallelMode", "MoeParallel"})
LAYOUT_STRINGS = frozenset({"mla-tp", "sp"})
CHUNK_ARITHMETIC = frozenset(
    {"chunk_owner", "local_index", "local_length", "local_position", "token_owner"}
)


def _sources() -> list[Path]:
    return [
        path
        for top in TOPS
        if (ROOT / top).is_dir()
        for path in sorted((ROOT / top).rglob("*.py"))
        if "gen" not in path.relative_to(ROOT).parts  # generated gRPC stubs
    ]


def _is_member(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in MODE_ENUMS
    )


def _defaults(tree: ast.AST) -> set[int]:
    """ids of the nodes that are a field's or a parameter's default value."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            out.add(id(node.value))
        elif isinstance(node, ast.arguments):
            out.update(id(d) for d in [*node.defaults, *node.kw_defaults] if d is not None)
    return out


def _names_a_layout(node: ast.AST) -> bool:
    """A layout's name as a string: a constant, or a member's `.value`."""
    if isinstance(node, ast.Constant):
        return node.value in LAYOUT_STRINGS
    return isinstance(node, ast.Attribute) and node.attr == "value" and _is_member(node.value)


def mode_checks(source: str) -> list[str]:
    """`line: what` for every place `source` asks which layout or MoE mode it runs."""
    tree = ast.parse(source)
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    defaults = _defaults(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute) and node.attr == "sp":
            found.append((line, "the .sp flag"))
        elif _is_member(node):
            parent = parents.get(id(node))
            named = isinstance(parent, ast.Attribute) and parent.attr == "value"
            if not named and id(node) not in defaults:
                assert isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                found.append((line, f"{node.value.id}.{node.attr}"))
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            inner = [n for o in operands for n in ast.walk(o)]
            if any(_names_a_layout(n) for n in inner):
                found.append((line, "a comparison with a layout's name"))
            chunk = any(isinstance(n, (ast.Name, ast.Attribute)) for n in operands) and any(
                getattr(n, "id", getattr(n, "attr", None)) == "chunk_size" for n in operands
            )
            if chunk and any(isinstance(n, ast.Constant) and n.value is None for n in operands):
                found.append((line, "chunk_size compared with None"))
        elif isinstance(node, ast.ImportFrom):
            names = {alias.name for alias in node.names} & CHUNK_ARITHMETIC
            if names:
                found.append((line, f"an import of SP chunk arithmetic ({', '.join(names)})"))
        elif isinstance(node, ast.Constant) and node.value == "mla-tp":
            found.append((line, 'the name "mla-tp" spelled out'))
    return [f"{line}: {what}" for line, what in sorted(found)]


def test_the_listed_modules_exist_and_the_sources_are_found() -> None:
    for module in LAYOUT_MODULES:
        assert (ROOT / module).is_file(), module
    assert mode_checks((ROOT / "common/parallel.py").read_text())  # it does name the modes


def test_only_the_listed_modules_ask_which_layout_they_run() -> None:
    outside = [
        f"{path.relative_to(ROOT)}:{check}"
        for path in _sources()
        if str(path.relative_to(ROOT)) not in LAYOUT_MODULES
        for check in mode_checks(path.read_text())
    ]
    assert outside == [], "layout checks outside LAYOUT_MODULES:\n" + "\n".join(outside)


def test_every_kind_of_check_is_caught() -> None:
    caught = mode_checks(
        "from kv_bookkeeping import chunk_owner\n"
        "from common.parallel import token_owner\n"
        "if par.sp:\n"
        "    pass\n"
        "x = par.mode is ParallelMode.SP\n"
        "y = ParallelConfig(2, 1, mode=ParallelMode.SP)\n"
        "z = par.moe is MoeParallel.EP\n"
        'w = name == "mla-tp"\n'
        "v = name == ParallelMode.SP.value\n"
        "u = pool.chunk_size is None\n"
    )
    assert [c.split(":")[0] for c in caught] == ["1", "2", "3", "5", "6", "7", "8", "8", "9", "10"]
    # What is not asking: a default, a name read as a string, a question put to the layout.
    assert not mode_checks(
        "class Request:\n"
        "    moe: MoeParallel = MoeParallel.TP\n"
        "def parse(moe: str = MoeParallel.TP.value) -> None: ...\n"
        "CONFIGS = (ParallelMode.TPLA.value, BASELINE.value)\n"
        "ranks = par.token_ranks if not par.caches_every_token else 1\n"
        'same = args.mode == "tpla"\n'
    )


def test_design_lists_the_same_modules() -> None:
    design = (ROOT / "docs/design.md").read_text()
    section = design.split("### What a new layout or MoE mode touches", 1)[1].split("\n#", 1)[0]
    bullets = [line.split("`")[1] for line in section.splitlines() if line.startswith("- `")]
    assert bullets == list(LAYOUT_MODULES)
