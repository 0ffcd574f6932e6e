"""Where a placed request's prompt is prefilled: on a prefill worker (remote, the KV shipped to
its decode group) or by its decode group itself (local, between its decode steps): pure logic.

`TPLA_DISAGG_POLICY`: `always` prefills remotely, `never` locally, and `auto` locally when the
part of the prompt the group does not hold (its Reserve answer's cached tokens taken off) is
at most `TPLA_LOCAL_PREFILL_MAX_TOKENS` and this router's local prefill tokens in flight on
the group stay within `TPLA_LOCAL_PREFILL_QUEUE_TOKENS`, else remotely: a short prompt, or a
chat turn whose history the group caches, costs less to prefill than the hop to a worker
does. Whatever the policy, a router without a prefill worker to use (none healthy, or the
prefill circuit open: services/router/prefill_circuit.py) prefills every prompt locally:
degraded, not down. Each decision says why (`RouteReason`): the request's record, the
metric `tpla:prefill_route_total{route,reason}` and its trace carry it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class DisaggPolicy(enum.Enum):
    ALWAYS = "always"  # every prompt on a prefill worker (while one can be used)
    AUTO = "auto"  # short or mostly cached prompts on their decode group
    NEVER = "never"  # every prompt on its decode group


class PrefillRoute(enum.Enum):
    LOCAL = "local"  # the decode group prefills it
    REMOTE = "remote"  # a prefill worker prefills it and ships its KV


class RouteReason(enum.Enum):
    """Why a prompt went where it went (the metric's `reason` label)."""

    POLICY = "policy"  # `always` or `never` says so
    SHORT = "short"  # auto: its uncached part is within the bound, the group has room
    LONG = "long"  # auto: its uncached part is over the bound
    GROUP_BUSY = "group_busy"  # auto: the group's local prefill queue is full
    NO_PREFILL_WORKER = "no_prefill_worker"  # degraded: no healthy prefill worker
    CIRCUIT_OPEN = "circuit_open"  # degraded: remote prefills keep failing
    REMOTE_FAILED = "remote_failed"  # its remote prefill failed: prefilled locally instead
    LOCAL_OFF = "local_off"  # its group does not prefill prompts itself


# Every (route, reason) a decision can give: the metric's series, created up front.
ROUTES = (
    (PrefillRoute.REMOTE, RouteReason.POLICY),
    (PrefillRoute.LOCAL, RouteReason.POLICY),
    (PrefillRoute.LOCAL, RouteReason.SHORT),
    (PrefillRoute.REMOTE, RouteReason.LONG),
    (PrefillRoute.REMOTE, RouteReason.GROUP_BUSY),
    (PrefillRoute.LOCAL, RouteReason.NO_PREFILL_WORKER),
    (PrefillRoute.LOCAL, RouteReason.CIRCUIT_OPEN),
    (PrefillRoute.LOCAL, RouteReason.REMOTE_FAILED),
    (PrefillRoute.REMOTE, RouteReason.LOCAL_OFF),
)


@dataclass(frozen=True)
class RouteDecision:
    route: PrefillRoute
    reason: RouteReason
    # A remote prefill that is the half-open prefill circuit's one trial (prefill_circuit.py).
    trial: bool = False

    @property
    def local(self) -> bool:
        return self.route is PrefillRoute.LOCAL


@dataclass(frozen=True)
class DisaggConfig:
    """The policy and `auto`'s bounds (the settings of the same names)."""

    policy: DisaggPolicy = DisaggPolicy.ALWAYS
    local_max_tokens: int = 512  # the largest uncached part a group prefills (auto)
    local_queue_tokens: int = 256  # this router's local tokens in flight on a group (auto)

    @classmethod
    def parse(cls, policy: str, local_max_tokens: int, local_queue_tokens: int) -> DisaggConfig:
        names = [p.value for p in DisaggPolicy]
        if policy not in names:
            raise ValueError(f"disagg policy {policy!r} is not one of {', '.join(names)}")
        return cls(DisaggPolicy(policy), local_max_tokens, local_queue_tokens)

    @property
    def uses_workers(self) -> bool:
        """Whether prefill workers serve any prompt (`never` needs none)."""
        return self.policy is not DisaggPolicy.NEVER


def decide(
    config: DisaggConfig, uncached: int, queued: int, degraded: RouteReason | None
) -> RouteDecision:
    """Where a prompt of `uncached` tokens its decode group lacks goes, with `queued` of this
    router's local prefill tokens in flight on that group; `degraded`: why no prefill worker
    can be used now (None: one can)."""
    if config.policy is DisaggPolicy.NEVER:
        return RouteDecision(PrefillRoute.LOCAL, RouteReason.POLICY)
    if degraded is not None:
        return RouteDecision(PrefillRoute.LOCAL, degraded)
    if config.policy is DisaggPolicy.ALWAYS:
        return RouteDecision(PrefillRoute.REMOTE, RouteReason.POLICY)
    if uncached > config.local_max_tokens:
        return RouteDecision(PrefillRoute.REMOTE, RouteReason.LONG)
    if queued + uncached > config.local_queue_tokens:
        return RouteDecision(PrefillRoute.REMOTE, RouteReason.GROUP_BUSY)
    return RouteDecision(PrefillRoute.LOCAL, RouteReason.SHORT)
