"""Every "DESIGN §n" a comment or document cites is a numbered section of docs/design.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITE = re.compile(r"DESIGN §(\d+)")
SECTION = re.compile(r"^## (\d+)\. ", re.MULTILINE)


def _citations() -> dict[str, set[int]]:
    found: dict[str, set[int]] = {}
    for top in ("common", "services", "tools", "README.md", "benchmarks", "docs"):
        base = ROOT / top
        paths = [base] if base.is_file() else [*base.rglob("*.py"), *base.rglob("*.md")]
        for path in paths:
            numbers = {int(n) for n in CITE.findall(path.read_text())}
            if numbers:
                found[str(path.relative_to(ROOT))] = numbers
    return found


def test_every_cited_section_exists() -> None:
    sections = {int(n) for n in SECTION.findall((ROOT / "docs" / "design.md").read_text())}
    cited = _citations()
    assert sections >= {1, 2, 3, 5} and len(cited) > 5
    missing = {path: sorted(n - sections) for path, n in cited.items() if n - sections}
    assert missing == {}
