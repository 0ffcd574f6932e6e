"""Chat-formatted training documents mined from the corpus: docstring -> function.

They teach the demo model the chat template's turn structure, so a chat completion through
the router answers with code instead of continuing a random file.
"""

from __future__ import annotations

import ast
import random
from collections.abc import Sequence

import jinja2

from tools.demo.tokenizer_train import CHAT_TEMPLATE

_MAX_FUNCTION_CHARS = 1500


def _render(messages: list[dict[str, str]], bos: str) -> str:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

    def fail(msg: str) -> None:
        raise ValueError(msg)

    template = env.from_string(CHAT_TEMPLATE)
    return template.render(
        messages=messages, bos_token=bos, add_generation_prompt=False, raise_exception=fail
    )


def _examples(source: str) -> list[tuple[str, str]]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    found = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = (ast.get_docstring(node) or "").strip()
        # Top-level functions only; slicing lines avoids get_source_segment's per-call re-split.
        code = "".join(lines[node.lineno - 1 : node.end_lineno]).rstrip()
        if not doc or not code or len(code) > _MAX_FUNCTION_CHARS:
            continue
        summary = doc.splitlines()[0].strip()
        if len(summary) >= 12:
            found.append((f"Write a Python function `{node.name}`: {summary}", code))
    return found


def chat_documents(
    docs: Sequence[str], *, bos: str, fraction: float = 0.1, seed: int = 0
) -> list[str]:
    """Chat transcripts totalling about `fraction` of the corpus's characters."""
    pairs = [pair for doc in docs for pair in _examples(doc)]
    random.Random(seed).shuffle(pairs)
    budget = fraction * sum(len(d) for d in docs)
    out: list[str] = []
    used = 0
    for prompt, code in pairs:
        text = _render(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": code}], bos
        )
        out.append(text)
        used += len(text)
        if used >= budget:
            break
    return out
