"""Erlang C: the stable recursion agrees with the textbook formula; the wait quantile is the
inverse of the exponential tail."""

from __future__ import annotations

import math

import pytest

from services.autoscaler.queueing import erlang_c, mean_wait_s, wait_quantile_s


def erlang_c_reference(n: int, a: float) -> float:
    """The textbook formula with factorials."""
    top = a**n / math.factorial(n) * n / (n - a)
    return top / (sum(a**k / math.factorial(k) for k in range(n)) + top)


@pytest.mark.parametrize(("n", "a"), [(1, 0.5), (2, 1.5), (4, 3.9), (10, 7.0), (30, 20.0)])
def test_recursion_matches_the_formula(n: int, a: float) -> None:
    assert erlang_c(n, a) == pytest.approx(erlang_c_reference(n, a), rel=1e-12)


def test_one_server_waits_with_probability_rho() -> None:
    assert erlang_c(1, 0.7) == pytest.approx(0.7)
    # M/M/1: mean wait rho / (mu - lam).
    assert mean_wait_s(1, 0.7, 1.0) == pytest.approx(0.7 / 0.3)


def test_unstable_and_idle_edges() -> None:
    assert erlang_c(3, 3.0) == 1.0 and erlang_c(3, 0.0) == 0.0
    assert math.isinf(wait_quantile_s(2, 4.0, 0.5, 0.9))
    assert wait_quantile_s(4, 0.1, 0.1, 0.9) == 0.0  # almost nobody waits


def test_wait_quantile_inverts_the_tail() -> None:
    n, rate, service, q = 3, 5.0, 0.5, 0.99
    t = wait_quantile_s(n, rate, service, q)
    tail = erlang_c(n, rate * service) * math.exp(-(n / service - rate) * t)
    assert tail == pytest.approx(1 - q)
    assert wait_quantile_s(n + 1, rate, service, q) < t
