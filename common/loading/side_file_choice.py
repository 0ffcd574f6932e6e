"""Which TPLA side file a model directory is served with (`TPLA_REPARAM`).

- `auto` (the default) prefers the calibrated basis: `tpla_pca.json` when the directory has
  one (what `tpla convert --method pca` writes), else the identity basis with e_i = 1/r and one
  warning. A checkpoint as downloaded has no side file and serves as it is.
- `none` or empty: the identity basis; no side file is read.
- any other value names a side file that is required (`tpla_hadamard`, `my_basis.json`, an
  absolute path): a missing one is a start-up error naming it.

A service resolves the setting once, when its config is built from the settings
(`resolve_reparam`); the config then carries a side file's name or None, which its ranks, the
prefix cache's identity and the loader read without a second warning. Pure Python (no torch):
the prefix cache's identity resolves it too.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

AUTO = "auto"
NONE = "none"
DEFAULT_SIDE_FILE = "tpla_pca"


def side_file_path(model_dir: str | Path, name: str) -> Path:
    """The file a side file's name means: `tpla_pca` -> `<model_dir>/tpla_pca.json`."""
    return Path(model_dir) / (name if name.endswith(".json") else f"{name}.json")


def resolve_reparam(model_dir: str | Path, reparam: str | None) -> str | None:
    """TPLA_REPARAM as a config carries it: the side file's name (as given, or `tpla_pca`
    where `auto` found it), or None for the identity basis. FileNotFoundError naming the file
    when a side file named explicitly does not exist."""
    value = (reparam or "").strip()
    if value.lower() in ("", NONE):
        return None
    if value.lower() == AUTO:
        if side_file_path(model_dir, DEFAULT_SIDE_FILE).is_file():
            return DEFAULT_SIDE_FILE
        log.warning(
            "no TPLA side file %s: serving with the identity basis, e_i = 1/r (uncalibrated); "
            "`tpla convert --model %s --method pca` writes it, TPLA_REPARAM=none silences this",
            side_file_path(model_dir, DEFAULT_SIDE_FILE),
            model_dir,
        )
        return None
    path = side_file_path(model_dir, value)
    if not path.is_file():
        raise FileNotFoundError(
            f"TPLA_REPARAM={value}: the side file {path} does not exist (write it with `tpla "
            "convert`, or set TPLA_REPARAM=auto to serve without one when it is absent)"
        )
    return value
