"""A prefill worker's config comes from the settings in one place (`prefill_config`), and
`tpla prefill`'s flags reach it as the settings they override."""

from __future__ import annotations

import argparse

import pytest

from common.runtime.settings import load_settings
from services.prefill.batch.threads import PrefillThreads
from services.prefill.config import PrefillGroupConfig, prefill_config, prefix_cache
from tools.cli.services import _settings, add_service_parsers


def test_the_settings_reach_the_worker_and_its_group() -> None:
    s = load_settings(
        model="/m",
        prefill_tp=2,
        transport="torch",
        internal_token="secret",
        prefix_cache_mb=8.0,
        prefill_batch_tokens=512,
        prefill_chunk_tokens=64,
        transfer_timeout_s=5.0,
        speculative="mtp",
        moe_parallel="ep",
    )
    cfg = prefill_config(s)
    assert (cfg.max_batch_tokens, cfg.chunk_tokens, cfg.transfer_timeout_s) == (512, 64, 5.0)
    assert cfg.threads == PrefillThreads.from_settings(s)
    group = cfg.group
    assert (group.model, group.tp, group.transport, group.token) == ("/m", 2, "torch", "secret")
    assert (group.prefix_cache_mb, group.mtp, group.moe_parallel) == (8.0, True, "ep")
    assert not group.in_process  # its ranks are spawned
    assert PrefillGroupConfig.from_json(group.to_json()) == group  # what a spawned rank reads


def test_a_worker_of_one_rank_runs_in_its_process() -> None:
    cfg = prefill_config(load_settings(model="/m", prefix_cache=False, prefix_cache_mb=8.0))
    assert cfg.group.in_process and cfg.group.tp == 1
    assert cfg.group.prefix_cache_mb == 0.0 and prefix_cache(cfg.group) is None
    assert cfg.chunk_tokens is None  # the device's default


def test_the_flags_override_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPLA_PREFILL_TP", "4")
    monkeypatch.setenv("TPLA_TRANSPORT", "grpc")
    parser = argparse.ArgumentParser()
    add_service_parsers(parser.add_subparsers())
    args = parser.parse_args(
        ["prefill", "--model", "/m", "--tp", "2", "--transport", "torch", "--port", "6001"]
    )
    s = _settings(args)
    cfg = prefill_config(s)
    assert (cfg.group.tp, cfg.group.transport, s.prefill_port) == (2, "torch", 6001)
    unset = prefill_config(_settings(parser.parse_args(["prefill", "--model", "/m"])))
    assert (unset.group.tp, unset.group.transport) == (4, "grpc")
