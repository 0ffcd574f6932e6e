"""A decode rank's share of the checkpoint in stored bytes, estimated before it loads: the
total its loading progress is shown against (common/runtime/load_meter.py)."""

from __future__ import annotations

from common.model.args import ModelConfig
from common.runtime.load_meter import current_meter
from common.tpla.rank_memory import rank_tensors
from common.tpla.share_bytes import share_bytes
from services.decode.config import EngineConfig


def expect_share(cfg: EngineConfig, rank: int) -> None:
    """Tell this thread's loading meter (if metered) rank `rank`'s share; an estimate that
    cannot be made leaves it unknown (the load itself names what is wrong)."""
    meter = current_meter()
    if meter is None:
        return
    try:
        c = ModelConfig.from_dir(cfg.model)
        mtp = 1 if cfg.speculative.method == "mtp" else 0
        meter.expect(share_bytes(cfg.model, rank_tensors(c, cfg.parallel, rank, mtp)))
    except (ValueError, OSError):
        return
