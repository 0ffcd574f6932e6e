"""A prefill worker's start: what its batches run on (the model loaded in this process, or
the prefill group of ranks it leads), under the batcher that feeds it."""

from __future__ import annotations

import logging

from common.kv.transfer import make_sender
from common.loading.serving_model import load_prefill_model, load_prefill_mtp
from common.runtime.metrics import PrefillMetrics
from common.sampling.grammar import GrammarCompiler
from services.prefill.config import PrefillConfig, PrefillGroupConfig, prefix_cache
from services.prefill.group.leader import GroupRunner
from services.prefill.group.rank_loader import expect_share, load_group_rank
from services.prefill.runner import LocalRunner, PrefillRunner
from services.prefill.worker import PrefillWorker

log = logging.getLogger(__name__)


def start_runner(cfg: PrefillGroupConfig) -> PrefillRunner:
    """The model of `cfg` in this process (tp = 1), or its group started with this process
    as rank 0; blocks until every rank has loaded its share. With `cfg.mtp` (the decode
    groups run MTP drafts) the MTP layer's prompt latents go with the others."""
    if not cfg.in_process:
        return GroupRunner.start(cfg, load_group_rank)
    expect_share(cfg, 0)
    model = load_prefill_model(
        cfg.model, cfg.reparam, cfg.dtype, cfg.kernels, cfg.device, cfg.weight_dtype
    )
    layer = None
    if cfg.mtp:
        layer = load_prefill_mtp(
            cfg.model, cfg.reparam, model, cfg.dtype, cfg.device, cfg.weight_dtype
        )
    sender = make_sender(cfg.transport, cfg.worker_id, cfg.token)
    return LocalRunner(model, sender, layer, cfg.index_cache_dtype)


def start_worker(cfg: PrefillConfig, metrics: PrefillMetrics) -> PrefillWorker:
    """The worker of `cfg` (its group's `worker_id` set), its runner started."""
    group = cfg.group
    runner = start_runner(group)
    model = runner.config
    return PrefillWorker(
        runner,
        metrics=metrics,
        transfer_timeout_s=cfg.transfer_timeout_s,
        threads=cfg.threads,
        max_batch_tokens=cfg.max_batch_tokens,
        chunk_tokens=cfg.chunk_tokens,
        grammars=GrammarCompiler.from_model_dir(
            group.model, model.vocab_size, model.eos_token_ids, cfg.grammar_limits
        ),
        prefix_cache=prefix_cache(group),
    )
