"""The pools a load trace meets, simulated from a performance profile: arrivals (Poisson at
the trace's rate) queue for prefill workers, each prefilling one prompt at the profile's
tokens/s for its length; a prefilled request joins the decode group with the fewest
sequences and advances at the group's inter-token latency for its batch and mean context
(beyond the profile's largest batch, latency grows in proportion to the batch). Time moves in
fixed ticks. Replicas come from a `Pools` policy consulted every interval: started replicas
serve after a start-up delay; a prefill worker told to go finishes its prompt, a decode group
finishes its streams (scale-in drains), and both hold their GPUs until then."""

from __future__ import annotations

import abc
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field

from services.autoscaler.profile import PerformanceProfile
from services.autoscaler.sizing import Observation, Replicas


@dataclass(frozen=True)
class Request:
    arrival: float
    prompt: int
    output: int


@dataclass(frozen=True)
class SimConfig:
    tick_s: float = 0.05
    interval_s: float = 30.0  # between two decisions of the policy
    start_prefill_s: float = 60.0  # a new replica's start-up (weights loaded, registered)
    start_decode_s: float = 120.0


class Pools(abc.ABC):
    @abc.abstractmethod
    def decide(self, obs: Observation, now: float, current: Replicas) -> Replicas:
        """The replicas wanted from now, given the last interval's load."""


@dataclass
class _Worker:
    ready_at: float
    job: Request | None = None
    left_s: float = 0.0
    leaving: bool = False


@dataclass
class _Group:
    ready_at: float
    seqs: list[list[float]] = field(default_factory=list)  # [tokens left, context]
    leaving: bool = False


@dataclass
class SimResult:
    ttft_s: list[float] = field(default_factory=list)  # per request, in arrival order of first
    first_at: list[float] = field(default_factory=list)
    itl: list[tuple[float, float, float]] = field(default_factory=list)  # (time, itl, tokens)
    replicas: list[tuple[float, int, int]] = field(default_factory=list)  # provisioned
    gpu_s: float = 0.0


def trace(rate_at: list[tuple[float, float]], end_s: float, prompt: int, output: int,
          seed: int) -> list[Request]:  # fmt: skip
    """Poisson arrivals whose rate is piecewise constant: (from time, requests/s) steps;
    prompt lengths vary +-50 % uniformly around `prompt`."""
    rng = random.Random(seed)
    out, t = [], 0.0
    steps = [*rate_at, (end_s, 0.0)]
    for (start, rate), (stop, _) in itertools.pairwise(steps):
        t = start
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= stop:
                break
            out.append(Request(t, int(prompt * rng.uniform(0.5, 1.5)), output))
    return out


def _itl(profile: PerformanceProfile, batch: int, context: float) -> float:
    top = profile.decode.max_batch
    if batch <= top:
        return profile.decode.itl(batch, context)
    return profile.decode.itl(top, context) * batch / top


def simulate(
    profile: PerformanceProfile, requests: list[Request], pools: Pools, start: Replicas,
    end_s: float, cfg: SimConfig,
) -> SimResult:  # fmt: skip
    res = SimResult()
    workers = [_Worker(0.0) for _ in range(start.prefill)]
    groups = [_Group(0.0) for _ in range(start.decode)]
    queue: deque[Request] = deque()
    pending = deque(requests)
    window: dict[str, float] = dict.fromkeys(("n", "prompt", "output", "ttft", "firsts"), 0.0)
    window |= {"itl_tokens": 0.0, "itl_sum": 0.0}
    t, next_decision = 0.0, cfg.interval_s
    while t < end_s:
        while pending and pending[0].arrival <= t:
            r = pending.popleft()
            queue.append(r)
            window["n"] += 1
            window["prompt"] += r.prompt
            window["output"] += r.output
        for w in workers:
            if w.ready_at > t:
                continue
            if w.job is not None:
                w.left_s -= cfg.tick_s
                if w.left_s <= 0:
                    res.ttft_s.append(t - w.job.arrival)
                    res.first_at.append(t)
                    window["ttft"] += t - w.job.arrival
                    window["firsts"] += 1
                    open_groups = [g for g in groups if g.ready_at <= t and not g.leaving]
                    target = min(open_groups or groups, key=lambda g: len(g.seqs))
                    target.seqs.append([w.job.output - 1.0, w.job.prompt])
                    w.job = None
            if w.job is None and queue and not w.leaving:
                w.job = queue.popleft()
                w.left_s = profile.prefill.service_s(w.job.prompt)
        for g in groups:
            if not g.seqs:
                continue
            ctx = sum(s[1] for s in g.seqs) / len(g.seqs)
            itl = _itl(profile, len(g.seqs), ctx)
            step = cfg.tick_s / itl
            for s in g.seqs:
                s[0] -= step
                s[1] += step
            res.itl.append((t, itl, step * len(g.seqs)))
            window["itl_sum"] += itl * step * len(g.seqs)
            window["itl_tokens"] += step * len(g.seqs)
            g.seqs = [s for s in g.seqs if s[0] > 0]
        workers = [w for w in workers if not (w.leaving and w.job is None)]
        groups = [g for g in groups if not (g.leaving and not g.seqs)]
        res.gpu_s += cfg.tick_s * (
            len(workers) * profile.prefill.gpus + len(groups) * profile.decode.gpus
        )
        if t >= next_decision:
            next_decision += cfg.interval_s
            obs = Observation(
                window_s=cfg.interval_s,
                request_rate=window["n"] / cfg.interval_s,
                prompt_tokens=window["prompt"] / window["n"] if window["n"] else 0.0,
                output_tokens=window["output"] / window["n"] if window["n"] else 0.0,
                ttft_mean_s=window["ttft"] / window["firsts"] if window["firsts"] else None,
                itl_mean_s=(
                    window["itl_sum"] / window["itl_tokens"] if window["itl_tokens"] else None
                ),
                queued=float(len(queue)),
                running=float(sum(len(g.seqs) for g in groups)),
            )
            window = dict.fromkeys(window, 0.0)
            live = Replicas(sum(not w.leaving for w in workers), sum(not g.leaving for g in groups))
            want = pools.decide(obs, t, live)
            _resize(workers, want.prefill, lambda t=t: _Worker(t + cfg.start_prefill_s))
            _resize(groups, want.decode, lambda t=t: _Group(t + cfg.start_decode_s))
        res.replicas.append(
            (t, sum(not w.leaving for w in workers), sum(not g.leaving for g in groups))
        )
        t += cfg.tick_s
    return res


def _resize(pool: list, want: int, new: object) -> None:
    """Add replicas, or mark the youngest for draining (Kubernetes removes the highest
    ordinal first; a replica still starting is the cheapest to give up)."""
    live = [r for r in pool if not r.leaving]
    for _ in range(want - len(live)):
        pool.append(new())  # type: ignore[operator]
    for r in sorted(live, key=lambda r: -r.ready_at)[: max(len(live) - want, 0)]:
        r.leaving = True


def quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    xs = sorted(values)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def weighted_quantile(samples: list[tuple[float, float, float]], q: float) -> float:
    """The q-quantile of ITL over tokens (each sample weighs its tokens)."""
    pairs = sorted((itl, tokens) for _, itl, tokens in samples)
    total, acc = sum(w for _, w in pairs), 0.0
    for itl, tokens in pairs:
        acc += tokens
        if acc >= q * total:
            return itl
    return math.nan
