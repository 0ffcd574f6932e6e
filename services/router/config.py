"""The request pipeline's limits and timeouts: one frozen dataclass, mapped from the
settings once by `app.create_app`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineConfig:
    model: str
    transport: str = "grpc"
    max_inflight: int = 64
    max_waiting: int = 256
    queue_timeout_s: float = 30.0
    max_inflight_per_group: int = 64
    request_timeout_s: float = 300.0
    token_timeout_s: float = 30.0
    migrate: bool = True
    # How long a failed worker or group is skipped: by then its registry record has expired.
    quarantine_s: float = 10.0
    log_prompts: bool = False
    # Remote prefills failing in a row that open the prefill circuit (prefill_circuit.py),
    # open for quarantine_s.
    prefill_circuit_failures: int = 3
