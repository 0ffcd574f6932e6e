"""Smoothing: up at once by a bounded step; down only after a cooldown in which every decision
asked for fewer, by a bounded step."""

from __future__ import annotations

from services.autoscaler.smoothing import RoleState, SmoothingConfig, smooth

CFG = SmoothingConfig(cooldown_s=60.0, max_step_up=2, max_step_down=1)


def test_scale_up_is_immediate_and_bounded() -> None:
    s = smooth(RoleState(2, 0.0), 9, 1.0, CFG)
    assert s == RoleState(4, 1.0)
    assert smooth(s, 9, 2.0, CFG) == RoleState(6, 2.0)


def test_scale_down_waits_for_the_cooldown_and_steps_by_one() -> None:
    s = RoleState(5, 0.0)
    assert smooth(s, 1, 59.0, CFG) == s
    s = smooth(s, 1, 60.0, CFG)
    assert s == RoleState(4, 60.0)
    assert smooth(s, 1, 100.0, CFG) == s  # the step restarted the cooldown


def test_a_flapping_target_does_not_flap_the_replicas() -> None:
    state, history = RoleState(3, 0.0), []
    for t in range(0, 300, 10):
        state = smooth(state, 2 if (t // 10) % 2 else 3, float(t), CFG)
        history.append(state.replicas)
    assert set(history) == {3}  # every dip lasted less than the cooldown


def test_a_lasting_dip_scales_in() -> None:
    state = RoleState(3, 0.0)
    for t in (10.0, 40.0, 59.0):
        state = smooth(state, 2, t, CFG)
        assert state.replicas == 3
    assert smooth(state, 2, 60.0, CFG) == RoleState(2, 60.0)
