"""The demo corpus: Python standard-library sources, split deterministically by file path.

Every machine with the same Python version reproduces the same train / calibration / eval
text without shipping any of it, so later stages (calibration, evaluation) can rebuild
exactly what the demo model was trained and measured on.
"""

from __future__ import annotations

import enum
import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# Buckets of 100 by path hash: 90 % train, 5 % calibration, 5 % eval.
_CALIB_BUCKETS = range(90, 95)
_EVAL_BUCKETS = range(95, 100)
FILE_SEPARATOR = "\n\n"


class Split(enum.Enum):
    TRAIN = "train"
    CALIBRATION = "calibration"
    EVAL = "eval"


def default_corpus_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str) -> Split:
    bucket = int(hashlib.sha256(relative_path.encode()).hexdigest(), 16) % 100
    if bucket in _EVAL_BUCKETS:
        return Split.EVAL
    if bucket in _CALIB_BUCKETS:
        return Split.CALIBRATION
    return Split.TRAIN


def corpus_files(root: Path | None = None) -> list[Path]:
    """All `.py` files under `root` (default: this Python's stdlib, minus site-packages)."""
    root = root or default_corpus_root()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus directory {root} does not exist")
    files = sorted(
        p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts
    )
    if not files:
        raise FileNotFoundError(f"no .py files under {root}")
    return files


def iter_documents(split: Split, root: Path | None = None) -> Iterator[str]:
    """Yield the text of each file of `split`, in path order (undecodable files skipped)."""
    root = root or default_corpus_root()
    for path in corpus_files(root):
        if split_of(path.relative_to(root).as_posix()) is not split:
            continue
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def split_text(split: Split, root: Path | None = None, max_chars: int | None = None) -> str:
    """The concatenated text of one split, optionally cut to its first `max_chars` characters."""
    text = FILE_SEPARATOR.join(iter_documents(split, root))
    return text if max_chars is None else text[:max_chars]


def calibration_text(max_chars: int | None = None, root: Path | None = None) -> str:
    return split_text(Split.CALIBRATION, root, max_chars)


def eval_text(max_chars: int | None = None, root: Path | None = None) -> str:
    return split_text(Split.EVAL, root, max_chars)
