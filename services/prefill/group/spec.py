"""A prefill group as common/group forms it: its `GroupSpec`, whose identity (model, dtype,
device, prefix cache, transport) every rank checks against the leader's."""

from __future__ import annotations

import functools

import torch

from common.group.spec import GroupSpec, config_digest
from services.prefill.config import PrefillGroupConfig

# What every rank must agree on (each computes the whole latent and ships from it, and
# holds a replica of the prefix cache), and the setting that changes it.
SETTINGS = (
    ("model", "TPLA_MODEL"),
    ("tp", "TPLA_PREFILL_TP / --group-size"),
    ("reparam", "TPLA_REPARAM"),
    ("dtype", "TPLA_DTYPE"),
    ("weight_dtype", "TPLA_WEIGHT_DTYPE"),
    ("index_cache_dtype", "TPLA_INDEX_CACHE_DTYPE"),
    ("device", "TPLA_DEVICE"),
    ("attention_backend", "TPLA_ATTENTION_BACKEND"),
    ("moe_parallel", "TPLA_MOE_PARALLEL"),
    ("prefix_cache_mb", "TPLA_PREFIX_CACHE / TPLA_PREFIX_CACHE_MB"),
    ("transport", "TPLA_TRANSPORT"),
    ("collectives", "TPLA_COLLECTIVES"),
    ("mtp", "TPLA_SPECULATIVE"),
)


def identity(cfg: PrefillGroupConfig) -> dict[str, str]:
    """What a prefill rank serves, as strings (the model as its config.json's digest)."""
    return {
        "model": config_digest(cfg.model),
        "tp": str(cfg.tp),
        "reparam": cfg.reparam or "none",
        "dtype": cfg.dtype,
        "weight_dtype": cfg.weight_dtype,
        "index_cache_dtype": cfg.index_cache_dtype,
        "device": torch.device(cfg.device).type,
        "attention_backend": cfg.kernels.prefill_attention,
        "moe_parallel": cfg.moe_parallel,
        "prefix_cache_mb": f"{cfg.prefix_cache_mb:g}",
        "transport": cfg.transport,
        "collectives": cfg.collectives,
        "mtp": "mtp" if cfg.mtp else "none or ngram",
    }


def group_spec(cfg: PrefillGroupConfig) -> GroupSpec:
    return GroupSpec.from_config(
        cfg,
        role="prefill",
        size=cfg.tp,
        spawned=cfg.spawned,
        port_setting="TPLA_PREFILL_DIST_PORT",
        identity=functools.partial(identity, cfg),
        settings=SETTINGS,
    )
