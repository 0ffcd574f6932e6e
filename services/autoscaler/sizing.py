"""Pool sizing: the fewest prefill workers and decode groups that meet the TTFT and ITL SLOs
for an observed load, from a performance profile corrected by what was observed.

TTFT is the prefill pool's: an M/M/n queue (services/autoscaler/queueing.py) whose service
time is a prompt's prefill time in the profile; the SLO holds for a quantile of TTFT. ITL is
the decode pool's: a group at batch b emits b / itl(b, context) tokens/s, so the pool needs
output demand / (the most tokens/s a group gives at a batch whose ITL meets the SLO) groups
(Dynamo's planner sizes its decode pool the same way). The two SLOs split along the two pools,
so the fewest of each is the fewest GPUs (counts times the profile's GPUs per worker/group).

The correction (as in Dynamo's planner): the profile measured one machine and one load; the
running system adds transfer, routing and interference. Observed mean TTFT over the mean the
model predicts for the pool as it ran, and observed mean ITL over the profile's at the batch
it ran, scale the model's latencies before sizing; clamped so one odd window cannot swing it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from services.autoscaler.profile import PerformanceProfile
from services.autoscaler.queueing import mean_wait_s, wait_quantile_s


@dataclass(frozen=True)
class Observation:
    """The load over one window, summed over the routers."""

    window_s: float
    request_rate: float  # requests/s
    prompt_tokens: float  # mean per request
    output_tokens: float  # mean per request
    ttft_mean_s: float | None  # None: no request got its first token in the window
    itl_mean_s: float | None
    queued: float  # requests waiting in the routers for an in-flight slot
    running: float  # requests admitted and not finished
    ttft_p99_s: float | None = None  # reported with a decision, not used to size
    itl_p99_s: float | None = None


@dataclass(frozen=True)
class Replicas:
    prefill: int
    decode: int


@dataclass(frozen=True)
class RoleBounds:
    min: int
    max: int

    def __post_init__(self) -> None:
        if not 0 <= self.min <= self.max:
            raise ValueError(f"bounds need 0 <= min <= max, got {self.min}..{self.max}")

    def clamp(self, n: int) -> int:
        return max(self.min, min(self.max, n))


@dataclass(frozen=True)
class SizingConfig:
    slo_ttft_s: float
    slo_itl_s: float
    prefill: RoleBounds
    decode: RoleBounds
    ttft_quantile: float = 0.9  # the SLO holds for this quantile of TTFT
    correction_range: tuple[float, float] = (0.5, 4.0)
    backlog_s: float = 30.0  # queued requests are served within this on top of the arrivals

    def __post_init__(self) -> None:
        if self.slo_ttft_s <= 0 or self.slo_itl_s <= 0:
            raise ValueError("SLOs are positive")
        if not 0 < self.ttft_quantile < 1:
            raise ValueError("the TTFT quantile is in (0, 1)")
        lo, hi = self.correction_range
        if not 0 < lo <= 1 <= hi:
            raise ValueError("the correction range holds 1")
        if self.backlog_s <= 0:
            raise ValueError("backlog_s is positive")


@dataclass(frozen=True)
class Sizing:
    """The pools' sizes for a load (within the bounds), and what decided them."""

    replicas: Replicas
    gpus: int
    prefill_correction: float
    decode_correction: float
    predicted_ttft_s: float  # the quantile, corrected, at the chosen prefill size
    predicted_itl_s: float  # corrected, at the batch the chosen decode size runs
    decode_batch: float  # per group at the chosen size
    ttft_attainable: bool  # False: even the upper bound misses the TTFT SLO
    itl_attainable: bool


# A pool busier than this (arrivals x service over workers) corrects nothing: a queue that is
# building or draining makes its TTFT a transient the steady-state model cannot match.
MODEL_VALID_LOAD = 0.8


def _clamp(x: float, bounds: tuple[float, float]) -> float:
    return max(bounds[0], min(bounds[1], x))


def decode_context(obs: Observation) -> float:
    """The mean context of a decoding sequence: its prompt and half its output."""
    return obs.prompt_tokens + obs.output_tokens / 2


def prefill_correction(
    profile: PerformanceProfile, obs: Observation, current: int, cfg: SizingConfig
) -> float:
    """Observed mean TTFT over the model's mean for `current` workers at the observed load;
    1.0 where there is nothing to compare (no traffic, a pool near saturation)."""
    if obs.ttft_mean_s is None or obs.request_rate <= 0 or current < 1:
        return 1.0
    service = profile.prefill.service_s(obs.prompt_tokens)
    if obs.request_rate * service >= MODEL_VALID_LOAD * current:
        return 1.0  # near saturation the queueing model says little about the system
    expected = service + mean_wait_s(current, obs.request_rate, service)
    return _clamp(obs.ttft_mean_s / expected, cfg.correction_range)


def decode_correction(
    profile: PerformanceProfile, obs: Observation, current: int, cfg: SizingConfig
) -> float:
    """Observed mean ITL over the profile's at the batch each group ran (Little's law:
    sequences decoding = output tokens/s x ITL) and the observed context; 1.0 beyond the
    profile's largest batch."""
    if obs.itl_mean_s is None or obs.request_rate <= 0 or current < 1:
        return 1.0
    decoding = obs.request_rate * obs.output_tokens * obs.itl_mean_s
    batch = max(decoding / current, 1.0)
    if batch > profile.decode.max_batch:
        return 1.0  # beyond the profile: nothing to compare with
    expected = profile.decode.itl(batch, decode_context(obs))
    return _clamp(obs.itl_mean_s / expected, cfg.correction_range)


def size_prefill(
    profile: PerformanceProfile, obs: Observation, correction: float, cfg: SizingConfig
) -> tuple[int, float, bool]:
    """(workers, predicted corrected TTFT quantile, attainable): the fewest workers within
    the bounds whose TTFT quantile meets the SLO, else the upper bound."""
    rate = obs.request_rate + obs.queued / cfg.backlog_s
    service = profile.prefill.service_s(max(obs.prompt_tokens, 1.0))
    bounds = cfg.prefill
    if rate <= 0:
        return bounds.min, correction * service, correction * service <= cfg.slo_ttft_s
    predicted = math.inf
    for n in range(max(bounds.min, 1), bounds.max + 1):
        predicted = correction * (service + wait_quantile_s(n, rate, service, cfg.ttft_quantile))
        if predicted <= cfg.slo_ttft_s:
            return n, predicted, True
    return bounds.max, predicted, False


def group_capacity(
    profile: PerformanceProfile, context: float, correction: float, slo_itl_s: float
) -> tuple[int, float]:
    """(batch, tokens/s): the batch at which one decode group gives the most output tokens/s
    with a corrected ITL within the SLO; (0, 0.0) when not even batch 1 meets it."""
    best = (0, 0.0)
    for batch in range(1, profile.decode.max_batch + 1):
        itl = profile.decode.itl(batch, context)
        if correction * itl <= slo_itl_s and batch / itl > best[1]:
            best = (batch, batch / itl)
    return best


def size_decode(
    profile: PerformanceProfile, obs: Observation, correction: float, cfg: SizingConfig
) -> tuple[int, float, float, bool]:
    """(groups, predicted corrected ITL, batch per group, attainable)."""
    context = decode_context(obs)
    bounds = cfg.decode
    demand = obs.request_rate * obs.output_tokens  # output tokens/s
    _, per_group = group_capacity(profile, context, correction, cfg.slo_itl_s)
    if per_group <= 0:
        itl = correction * profile.decode.itl(1, context)
        return bounds.max, itl, 1.0, False
    groups = bounds.clamp(math.ceil(demand / per_group - 1e-9)) if demand > 0 else bounds.min
    if groups < 1:
        return groups, 0.0, 0.0, True
    # The batch the pool then runs: solve batch = demand x itl(batch) / groups by bisection
    # (the right side grows slower than the left in every measured profile).
    lo, hi = 0.0, float(profile.decode.max_batch)
    for _ in range(60):
        mid = (lo + hi) / 2
        need = demand * correction * profile.decode.itl(max(mid, 1.0), context) / groups
        lo, hi = (mid, hi) if need > mid else (lo, mid)
    batch = max(hi, 1.0)
    itl = correction * profile.decode.itl(batch, context)
    return groups, itl, batch, itl <= cfg.slo_itl_s


def size(
    profile: PerformanceProfile,
    obs: Observation,
    current: Replicas,
    cfg: SizingConfig,
    rates: tuple[float, float] | None = None,
) -> Sizing:
    """The sizing for `obs`, which was observed while `current` replicas served. `rates`: the
    request rates to size the prefill and the decode pool for (a forecast; default the
    observed rate); the corrections always compare with the load as observed."""
    p_corr = prefill_correction(profile, obs, current.prefill, cfg)
    d_corr = decode_correction(profile, obs, current.decode, cfg)
    p_rate, d_rate = rates if rates is not None else (obs.request_rate, obs.request_rate)
    p_obs = dataclasses.replace(obs, request_rate=p_rate)
    d_obs = dataclasses.replace(obs, request_rate=d_rate)
    workers, ttft, ttft_ok = size_prefill(profile, p_obs, p_corr, cfg)
    groups, itl, batch, itl_ok = size_decode(profile, d_obs, d_corr, cfg)
    return Sizing(
        replicas=Replicas(workers, groups),
        gpus=workers * profile.prefill.gpus + groups * profile.decode.gpus,
        prefill_correction=p_corr,
        decode_correction=d_corr,
        predicted_ttft_s=ttft,
        predicted_itl_s=itl,
        decode_batch=batch,
        ttft_attainable=ttft_ok,
        itl_attainable=itl_ok,
    )
