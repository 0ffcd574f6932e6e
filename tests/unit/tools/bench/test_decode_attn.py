"""`tpla bench decode-attn`'s arguments are checked before anything is timed."""

from __future__ import annotations

import pytest

from tools.bench.decode_attn import run_bench
from tools.bench.roofline import Roofline


def test_decode_attn_rounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rounds"):
        run_bench(Roofline(1e11, 1e10, 1, 256, 16.0), quick=True, names=["demo"], rounds=0)
