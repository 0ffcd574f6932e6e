"""A prefill group's `GroupSpec` reads its config as a decode group's does (one builder,
`GroupSpec.from_config`); only the role, size, launch, port setting and identity differ."""

from __future__ import annotations

import services.decode.group.spec
import services.prefill.group.spec
from common.parallel import ParallelConfig
from services.decode.config import EngineConfig, Launch
from services.prefill.config import PrefillGroupConfig


def test_one_builder_serves_both_services_groups() -> None:
    """Decode's and prefill's specs read their rendezvous, device, collectives, timeouts and
    addresses alike from their configs (`GroupSpec.from_config`)."""
    decode = EngineConfig(
        "/m",
        ParallelConfig(tp=2),
        device="cuda:1",
        collectives="dist",
        master_addr="10.0.0.1",
        master_port=29501,
        join_timeout_s=7.0,
        collective_timeout_s=9.0,
        shm_path="/dev/shm/g",
        host="0.0.0.0",
        advertise_host="10.0.0.2",
        launch=Launch.JOIN,
    )
    prefill = PrefillGroupConfig(
        "/m",
        tp=3,
        device="cuda:1",
        collectives="dist",
        master_addr="10.0.0.1",
        master_port=29501,
        join_timeout_s=7.0,
        collective_timeout_s=9.0,
        shm_path="/dev/shm/g",
        host="0.0.0.0",
        spawned=False,
    )
    for spec, role, size, setting in (
        (services.decode.group.spec.group_spec(decode), "decode", 2, "TPLA_DIST_PORT"),
        (services.prefill.group.spec.group_spec(prefill), "prefill", 3, "TPLA_PREFILL_DIST_PORT"),
    ):
        assert (spec.role, spec.size, spec.port_setting, spec.spawned) == (
            role,
            size,
            setting,
            False,
        )
        assert (spec.device, spec.collectives, spec.address) == ("cuda:1", "dist", "10.0.0.1:29501")
        assert (spec.join_timeout_s, spec.collective_timeout_s) == (7.0, 9.0)
        assert (spec.shm_path, spec.host) == ("/dev/shm/g", "0.0.0.0")
    # The advertised host: the config's, else the bound one.
    assert services.decode.group.spec.group_spec(decode).advertise_host == "10.0.0.2"
    assert services.prefill.group.spec.group_spec(prefill).advertise_host == "0.0.0.0"
    assert services.decode.group.spec.group_spec(decode).setting("chunk_size") == "TPLA_CHUNK_SIZE"
    assert services.prefill.group.spec.group_spec(prefill).setting("mtp") == "TPLA_SPECULATIVE"
