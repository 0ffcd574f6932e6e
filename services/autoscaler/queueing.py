"""The M/M/n queue (Erlang C) a prefill pool is modelled as: requests arrive at rate `lam`,
each takes `service_s` of one of `n` workers, first come first served. The waiting-time tail
is exponential, P(W > t) = C(n, a) exp(-(n/S - lam) t), so a quantile of the wait has a
closed form; an unstable pool (a = lam S >= n) waits without bound."""

from __future__ import annotations

import math


def erlang_c(n: int, offered: float) -> float:
    """Probability that an arrival waits, with `n` servers and `offered` = lam * S erlangs.
    Erlang B by its stable recursion, then C = n B / (n - a (1 - B)); 1.0 when unstable."""
    if n < 1:
        raise ValueError("at least one server")
    if offered <= 0:
        return 0.0
    if offered >= n:
        return 1.0
    b = 1.0
    for k in range(1, n + 1):
        b = offered * b / (k + offered * b)
    return n * b / (n - offered * (1.0 - b))


def wait_quantile_s(n: int, rate: float, service_s: float, q: float) -> float:
    """The q-quantile of the time a request waits for a worker (inf when unstable)."""
    if not 0 < q < 1:
        raise ValueError("a quantile is in (0, 1)")
    offered = rate * service_s
    if offered >= n:
        return math.inf
    c = erlang_c(n, offered)
    if c <= 1 - q:
        return 0.0
    return math.log(c / (1 - q)) / (n / service_s - rate)


def mean_wait_s(n: int, rate: float, service_s: float) -> float:
    """The mean time a request waits for a worker (inf when unstable)."""
    offered = rate * service_s
    if offered >= n:
        return math.inf
    return erlang_c(n, offered) / (n / service_s - rate)
