"""The analytic work of one decode-attention call, which `tpla bench decode-attn` measures
against and its figure projects onto GPUs: the shapes benchmarked, each layout's heads and
latent width per device, the matmul FLOPs and ideal bytes of one step (`DeviceWork`), and the
published peaks of the GPUs."""

from __future__ import annotations

from dataclasses import dataclass

from common.model.args import ModelConfig
from common.parallel import BASELINE, ParallelConfig, ParallelMode, span

BLOCK_SIZE = 16  # the engine's default (EngineConfig.block_size)

TP = 2
# The layouts a decode-attention call is measured in, on one device of TP: head-parallel MLA
# (the baseline) and TPLA at r = TP.
MODES = (BASELINE.value, ParallelMode.TPLA.value)


@dataclass(frozen=True)
class AttnShape:
    name: str
    heads: int
    d_c: int
    d_r: int
    d_n: int
    d_v: int


def shapes(demo_dir: str = "models/demo") -> list[AttnShape]:
    demo = ModelConfig.from_dir(demo_dir)
    return [
        AttnShape("deepseek-v3", 128, 512, 64, 128, 128),
        AttnShape("deepseek-v2-lite", 16, 512, 64, 128, 128),
        AttnShape(
            "demo",
            demo.num_attention_heads,
            demo.kv_lora_rank,
            demo.qk_rope_head_dim,
            demo.qk_nope_head_dim,
            demo.v_head_dim,
        ),
    ]


@dataclass(frozen=True)
class Accelerator:
    """Published peak numbers for a projection; the roofline model, not a measurement."""

    name: str
    bytes_per_s: float
    flops_per_s: float  # dense bf16
    itemsize: int = 2

    def bound_seconds(self, work: DeviceWork) -> float:
        return max(work.bytes(self.itemsize) / self.bytes_per_s, work.flops() / self.flops_per_s)


GPUS = (
    Accelerator("H100 SXM", 3.35e12, 989e12),
    Accelerator("H200", 4.8e12, 989e12),
)


@dataclass(frozen=True)
class DeviceWork:
    """One device's attention work for one decode step of one layer."""

    heads: int  # heads on this device
    width: int  # latent columns cached on this device (d_c or d_c / r)
    d_r: int
    d_n: int
    d_v: int
    batch: int
    context: int  # cached tokens per sequence (all valid)

    def flops(self) -> float:
        """q~ = W_UK^T q_nope, scores over [n | k_pe], u = p n, o = W_UV u (2 per MAC)."""
        b, h, w, t = self.batch, self.heads, self.width, self.context
        absorb = 2 * b * h * self.d_n * w
        scores = 2 * b * h * t * (w + self.d_r)
        values = 2 * b * h * t * w
        out = 2 * b * h * w * self.d_v
        return float(absorb + scores + values + out)

    def bytes(self, itemsize: int = 4) -> float:
        """Cache read once, W_UK and W_UV slices, the queries in and the values out."""
        b, h, w, t = self.batch, self.heads, self.width, self.context
        cache = b * t * (w + self.d_r)
        weights = h * (self.d_n + self.d_v) * w
        queries = b * h * (self.d_n + self.d_r)
        out = b * h * self.d_v
        return float(itemsize * (cache + weights + queries + out))


def per_device(shape: AttnShape, mode: str, ranks: int = TP) -> tuple[int, int]:
    """(heads, latent width) on one device, as the layout slices them (one of `MODES`):
    head-parallel MLA splits the heads, TPLA (r = ranks) the latent."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    par = ParallelConfig.parse(mode, ranks, ranks)
    return span(par.heads(0, shape.heads)), span(par.latent_columns(0, shape.d_c))


def device_work(shape: AttnShape, mode: str, batch: int, context: int) -> DeviceWork:
    heads, width = per_device(shape, mode)
    return DeviceWork(heads, width, shape.d_r, shape.d_n, shape.d_v, batch, context)


def grid(quick: bool) -> list[tuple[int, int]]:
    """(context, batch) pairs; large batches only where the pool stays a few hundred MB."""
    if quick:
        return [(c, b) for c in (1024, 4096) for b in (1, 4)]
    contexts = (1024, 2048, 4096, 8192, 16384, 32768)
    return [(c, b) for c in contexts for b in (1, 4, 16) if c * b <= 65536]
