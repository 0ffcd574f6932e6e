"""A decode group as common/group forms it: its `GroupSpec`, whose identity (model, layout,
cache shape) every rank checks against the leader's."""

from __future__ import annotations

import functools

import torch

from common.group.spec import GroupSpec, config_digest
from services.decode.config import EngineConfig, Launch

# What every rank must agree on, and the setting that changes it.
SETTINGS = (
    ("model", "TPLA_MODEL"),
    ("tp", "TPLA_TP / --group-size"),
    ("latent_groups", "TPLA_LATENT_GROUPS"),
    ("parallel", "TPLA_PARALLEL"),
    ("rmsnorm", "TPLA_RMSNORM"),
    ("chunk_size", "TPLA_CHUNK_SIZE"),
    ("reparam", "TPLA_REPARAM"),
    ("block_size", "TPLA_BLOCK_SIZE"),
    ("dtype", "TPLA_DTYPE"),
    ("index_cache_dtype", "TPLA_INDEX_CACHE_DTYPE"),
    ("kv_budget_mb", "TPLA_KV_BUDGET_MB"),
    ("device", "TPLA_DEVICE"),
    ("collectives", "TPLA_COLLECTIVES"),
    ("local_prefill", "TPLA_LOCAL_PREFILL_CHUNK_TOKENS"),
)


def identity(cfg: EngineConfig) -> dict[str, str]:
    """What a rank serves, as strings. The model is its config.json's digest (ranks on other
    hosts may mount it at other paths); the KV budget sizes every rank's block pool, which
    the leader's scheduler assumes is one size; the device kind picks the data group."""
    par = cfg.parallel
    return {
        "model": config_digest(cfg.model),
        "tp": str(par.tp),
        "latent_groups": str(par.latent_groups),
        "parallel": par.name,
        "rmsnorm": par.rmsnorm.value,
        "chunk_size": "-" if par.caches_every_token else str(par.chunk_size),
        "reparam": cfg.reparam or "none",
        "block_size": str(cfg.block_size),
        "dtype": cfg.dtype,
        "index_cache_dtype": cfg.index_cache_dtype,
        "kv_budget_mb": f"{cfg.kv_budget_mb:g}",
        "device": torch.device(cfg.device).type,
        "collectives": cfg.collectives,
        # Whether the ranks hold prefill weights; the chunk is the leader's alone.
        "local_prefill": "on" if cfg.local_prefill else "off",
    }


def group_spec(cfg: EngineConfig) -> GroupSpec:
    return GroupSpec.from_config(
        cfg,
        role="decode",
        size=cfg.parallel.tp,
        spawned=cfg.launch is Launch.SPAWN,
        port_setting="TPLA_DIST_PORT",
        identity=functools.partial(identity, cfg),
        settings=SETTINGS,
    )
