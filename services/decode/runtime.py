"""What every decode rank runs: its config, its model share and KV pool, and its step.

The leader (rank 0) and follower ranks share `RankRuntime`; only the leader schedules. A
follower is a separate OS process started as `python -m services.decode.runtime CONFIG_JSON
RANK`, so nothing but JSON and tensors crosses a process boundary.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from common.kv.paged_cache import PagedLatentCache, slot_table
from common.model.loader import load_model
from common.model.tpla import RmsNormMode, latent_shards
from services.decode.plan import DecodePlan, WritePlan, recv_plan
from services.decode.rank_model import ParallelConfig, RankModel


@dataclass(frozen=True)
class EngineConfig:
    model: str
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    reparam: str | None = None  # side file name in the model dir, e.g. "tpla_pca"
    block_size: int = 16
    kv_budget_mb: float = 256.0  # per rank
    max_batch: int = 32
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    dtype: str = "float32"
    lease_seconds: float = 30.0
    torch_threads: int = 1
    master_port: int = 29500
    collective_timeout_s: float = 120.0
    record_logits: bool = False  # keep each step's logits on token events (tests, eval)

    def to_json(self) -> str:
        raw = dataclasses.asdict(self)
        raw["parallel"]["rmsnorm"] = self.parallel.rmsnorm.value
        return json.dumps(raw)

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        raw = json.loads(text)
        par = raw.pop("parallel")
        par["rmsnorm"] = RmsNormMode(par["rmsnorm"])
        return cls(parallel=ParallelConfig(**par), **raw)


def layer_spectra(cfg: EngineConfig, model: torch.nn.Module) -> list[Tensor | None]:
    """Per-layer latent spectra (and, if needed, the rotation applied to the weights)."""
    if cfg.reparam is None:
        return [None] * model.config.num_hidden_layers
    from common.tpla.convert import apply_reparameterization

    return list(apply_reparameterization(model, Path(cfg.model) / cfg.reparam))


class RankRuntime:
    """One rank's model share and KV pool; `step` runs a decode plan on this rank."""

    def __init__(self, cfg: EngineConfig, rank: int) -> None:
        self.cfg, self.rank = cfg, rank
        torch.set_num_threads(cfg.torch_threads)
        full = load_model(cfg.model, dtype=cfg.dtype)
        spectra = layer_spectra(cfg, full)
        r = cfg.parallel.latent_groups
        shards = [latent_shards(full.config.kv_lora_rank, r, s) for s in spectra]
        self.model = RankModel(full, cfg.parallel, rank, shards)
        del full  # only this rank's share stays resident
        self.layout = self.model.cache_layout(cfg.block_size, getattr(torch, cfg.dtype))
        num_blocks = self.layout.blocks_for_budget(int(cfg.kv_budget_mb * 2**20))
        self.cache = PagedLatentCache(self.layout, num_blocks)

    def all_reduce(self, t: Tensor) -> None:
        if self.cfg.parallel.tp > 1:
            dist.all_reduce(t)

    def step(self, plan: DecodePlan) -> Tensor:
        """Run one decode step; returns this rank's padded logits slice [B, V/tp]."""
        bs = self.cfg.block_size
        positions = plan.positions
        rows = torch.arange(len(positions))
        write_slots = plan.block_tables[rows, positions // bs] * bs + positions % bs
        slots, valid = slot_table(plan.block_tables, positions + 1, bs)
        return self.model.decode_step(
            plan.tokens, positions, write_slots, slots, valid, self.cache, self.all_reduce
        )

    def receive_write(self, plan: WritePlan) -> None:
        """Follower side of a local KV write: receive the shard from the leader."""
        if plan.target != self.rank:
            return
        n_layers, n = self.layout.num_layers, len(plan.slots)
        lat = torch.empty(n_layers, n, self.layout.latent_width, dtype=self.layout.dtype)
        rope = torch.empty(n_layers, n, self.layout.rope_width, dtype=self.layout.dtype)
        dist.recv(lat, src=0)
        dist.recv(rope, src=0)
        self.cache.write_all_layers(plan.slots, lat, rope)


def init_group(cfg: EngineConfig, rank: int) -> None:
    if cfg.parallel.tp == 1:
        return
    backend = "nccl" if torch.cuda.is_available() and os.environ.get("TPLA_NCCL") == "1" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{cfg.master_port}",
        world_size=cfg.parallel.tp,
        rank=rank,
        timeout=timedelta(seconds=cfg.collective_timeout_s),
    )


def follower_main(cfg: EngineConfig, rank: int) -> None:
    """A follower rank: execute the leader's plans until shutdown."""
    init_group(cfg, rank)
    runtime = RankRuntime(cfg, rank)
    dist.barrier()  # the leader waits until every rank has loaded its share
    while True:
        plan = recv_plan()
        if plan is None:
            break
        if isinstance(plan, DecodePlan):
            logits = runtime.step(plan)
            dist.gather(logits, dst=0)
        else:
            runtime.receive_write(plan)
    dist.destroy_process_group()


if __name__ == "__main__":
    follower_main(EngineConfig.from_json(sys.argv[1]), int(sys.argv[2]))
