"""Smoothing against flapping: a role's replica count rises at once when the sizing asks for
more (an SLO is at stake), by at most `max_step_up` per decision; it falls only once every
decision for `cooldown_s` asked for fewer (the stabilization window of Kubernetes' HPA), by
at most `max_step_down` per decision: a brief dip in the load must not drain groups that the
next minute needs again."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SmoothingConfig:
    cooldown_s: float = 300.0
    max_step_up: int = 4
    max_step_down: int = 1

    def __post_init__(self) -> None:
        if self.cooldown_s < 0 or self.max_step_up < 1 or self.max_step_down < 1:
            raise ValueError("cooldown >= 0 and steps >= 1")


@dataclass(frozen=True)
class RoleState:
    replicas: int
    needed_at: float  # the last time `replicas` changed or a decision asked for no fewer


def smooth(state: RoleState, target: int, now: float, cfg: SmoothingConfig) -> RoleState:
    """The next replica count of a role that runs `state` when the sizing asks for `target`."""
    if target > state.replicas:
        return RoleState(min(target, state.replicas + cfg.max_step_up), now)
    if target == state.replicas:
        return RoleState(state.replicas, now)
    if now - state.needed_at >= cfg.cooldown_s:
        return RoleState(max(target, state.replicas - cfg.max_step_down), now)
    return state
