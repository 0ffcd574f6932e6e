"""The checkpoint bytes a rank reads for its share, estimated before it reads: its tensors as
the capacity plan counts them (common/tpla/rank_memory.py) in the checkpoint's stored format
(FP8 blocks with their scales, else config.json's `torch_dtype`). The total of a rank's
loading progress (common/runtime/load_meter.py); a rank reads about this much (a few
replicated checks read more), so progress is shown against it, capped below 100 % until the
rank has loaded."""

from __future__ import annotations

import json
from pathlib import Path

from common.tpla.rank_memory import DTYPE_BYTES, FP8, RankTensor, weight_bytes


def stored_format(model_dir: str | Path) -> tuple[str, tuple[int, int]]:
    """(weight dtype as the plan names it, FP8 block) of the checkpoint's linear weights."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    quant = raw.get("quantization_config") or {}
    if quant.get("quant_method") == "fp8":
        block = quant.get("weight_block_size") or [128, 128]
        return FP8, (int(block[0]), int(block[1]))
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32")
    return (dtype if dtype in DTYPE_BYTES else "float32"), (128, 128)


def share_bytes(model_dir: str | Path, tensors: list[RankTensor]) -> int:
    """The stored bytes of `tensors` (a rank's share) in `model_dir`'s checkpoint."""
    dtype, block = stored_format(model_dir)
    return weight_bytes(tensors, dtype, block)
