"""No source file in common/, services/, tools/, loadtest/ or docker/ is over 450 lines (the
generated gRPC stubs aside), and no function there over 80 (Triton kernels aside: a kernel is
one launch, its body the GPU program): a module that outgrows the first does more than one
thing and is split; a function that outgrows the second holds steps that want names
(docs/design.md §11)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILE_LIMIT = 450
FUNCTION_LIMIT = 80
TOPS = ("common", "services", "tools", "loadtest", "docker")
SOURCE_SUFFIXES = {".py", ".cpp", ".h"}
# A Triton kernel: decorated as one, or handed to the wrappers that compile or interpret it.
KERNEL_DECORATORS = {"triton.jit", "jit", "triton.autotune", "triton.heuristics"}
KERNEL_WRAPPERS = {"JITFunction", "InterpretedFunction", "wrap", "triton.jit"}


def _sources(suffixes: set[str]) -> list[Path]:
    return [
        path
        for top in TOPS
        for path in sorted((ROOT / top).rglob("*"))
        if path.suffix in suffixes and "gen" not in path.relative_to(ROOT).parts
    ]


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_source_file_is_over_the_limit() -> None:
    sizes = {str(path.relative_to(ROOT)): _lines(path) for path in _sources(SOURCE_SUFFIXES)}
    assert len(sizes) > 50  # the walk found the sources
    assert any(name.startswith("tools/") for name in sizes)
    over = {name: n for name, n in sizes.items() if n > FILE_LIMIT}
    assert over == {}, f"files over {FILE_LIMIT} lines: {over}"


def kernels(tree: ast.AST) -> set[str]:
    """The names of the module's Triton kernels (`KERNEL_DECORATORS`, `KERNEL_WRAPPERS`)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
            ast.unparse(d.func if isinstance(d, ast.Call) else d) in KERNEL_DECORATORS
            for d in node.decorator_list
        ):
            found.add(node.name)
        if (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in KERNEL_WRAPPERS
            and node.args
            and isinstance(node.args[0], ast.Name)
        ):
            found.add(node.args[0].id)
    return found


def long_functions(source: str, limit: int = FUNCTION_LIMIT) -> dict[str, int]:
    """Each function (methods and nested ones too) over `limit` lines, but kernels."""
    tree = ast.parse(source)
    exempt = kernels(tree)
    return {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name not in exempt
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > limit
    }


def test_no_function_is_over_the_limit() -> None:
    over = {
        f"{path.relative_to(ROOT)}::{name}": n
        for path in _sources({".py"})
        for name, n in long_functions(path.read_text(encoding="utf-8")).items()
    }
    assert over == {}, f"functions over {FUNCTION_LIMIT} lines: {over}"


def test_a_long_function_is_caught_and_a_kernel_is_not() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(5))
    source = (
        f"import triton\n\ndef long():\n{body}\n\n@triton.jit\ndef k():\n{body}\n\n"
        f"def wrapped():\n{body}\n\nw = JITFunction(wrapped)\n"
    )
    assert long_functions(source, limit=5) == {"long": 6}
