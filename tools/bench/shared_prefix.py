"""`tpla bench serve --mixes shared-prefix`: multi-turn chat over one shared system prompt,
with the prefix cache on and off in one run.

U users share one system prompt (S tokens of source text); each holds a conversation of T
turns: turn k's prompt is the system prompt, every earlier question and answer (the answer as
the stack returned it, re-tokenized, as a chat client resends it) and a new question. Users
run concurrently, each turn after the previous one's answer (a closed loop per user). The
same stack (`tpla serve`, TPLA tp=2) runs once with TPLA_PREFIX_CACHE=1 and once with 0;
greedy decoding makes both serve the same conversations.

Per setting: TTFT p50 / p99, output tokens/s over the wall time, prefill core-seconds (the
prefill worker process's user + system CPU time over the run, all its threads), and the
prompt tokens the stack reported as cached (`usage.prompt_tokens_details.cached_tokens`).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

import httpx

from tools.bench.serve_stack import stream_completion
from tools.bench.stats import RequestTiming, percentile, summarize

REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class SharedPrefixConfig:
    model: str
    users: int = 16
    turns: int = 4
    system_tokens: int = 1536
    question_tokens: int = 32
    max_tokens: int = 32
    reparam: str = "tpla_pca"

    def __post_init__(self) -> None:
        if min(self.users, self.turns, self.system_tokens, self.max_tokens) < 1:
            raise ValueError("users, turns, system_tokens and max_tokens must be positive")


@dataclass
class Turn:
    timing: RequestTiming
    prompt_tokens: int
    cached_tokens: int
    text: str


def corpus(model: str, cfg: SharedPrefixConfig) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt and each user's questions (distinct windows of other text)."""
    import argparse
    import dataclasses
    import inspect

    from common.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model)
    ids: list[int] = []
    for module in (argparse, json.decoder, dataclasses, inspect):
        ids += tok.encode(inspect.getsource(module), add_bos=False)
    need = cfg.system_tokens + cfg.users * cfg.turns * cfg.question_tokens
    if len(ids) < need:
        raise ValueError(f"not enough text: {len(ids)} tokens, {need} needed")
    system = ids[: cfg.system_tokens]
    rest = ids[cfg.system_tokens :]
    q = cfg.question_tokens
    questions = [
        [rest[(u * cfg.turns + k) * q : (u * cfg.turns + k + 1) * q] for k in range(cfg.turns)]
        for u in range(cfg.users)
    ]
    return system, questions


async def _turn(
    client: httpx.AsyncClient, url: str, prompt: Sequence[int], max_tokens: int
) -> Turn:
    got = await stream_completion(client, url, "bench", prompt, max_tokens)
    return Turn(got.timing, len(prompt), got.cached_tokens, got.text)


async def _conversations(url: str, cfg: SharedPrefixConfig) -> tuple[list[list[Turn]], float]:
    from common.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(cfg.model)
    system, questions = corpus(cfg.model, cfg)
    limits = httpx.Limits(max_connections=cfg.users + 4)

    async def user(client: httpx.AsyncClient, u: int) -> list[Turn]:
        history: list[int] = []
        turns = []
        for k in range(cfg.turns):
            prompt = [*system, *history, *questions[u][k]]
            turn = await _turn(client, url, prompt, cfg.max_tokens)
            turns.append(turn)
            history += [*questions[u][k], *tok.encode(turn.text, add_bos=False)]
        return turns

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as c:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(user(c, u) for u in range(cfg.users)))
        return list(done), time.perf_counter() - t0


def _prefill_cpu_s(url: str) -> float:
    """User + system CPU seconds of the stack's prefill worker processes so far."""
    import psutil

    workers = httpx.get(f"{url}/admin/workers", timeout=10).json()
    total = 0.0
    for w in workers:
        if w["role"] == "prefill":
            times = psutil.Process(w["pid"]).cpu_times()
            total += times.user + times.system
    return total


def run_setting(cfg: SharedPrefixConfig, cache: bool) -> dict:
    """One stack with the prefix cache on or off: the conversations and their numbers."""
    from tools.bench.serve_stack import StackConfig
    from tools.local_stack import LocalStack

    stack_cfg = StackConfig("tpla", 2, cfg.reparam)
    settings = {**stack_cfg.settings(), "PREFIX_CACHE": "1" if cache else "0"}
    with LocalStack.start(cfg.model, **settings) as stack:
        # One untimed request first (connections, first-call paths), unrelated to the corpus.
        asyncio.run(_warm(stack.url))
        cpu0 = _prefill_cpu_s(stack.url)
        conversations, wall = asyncio.run(_conversations(stack.url, cfg))
        prefill_cpu = _prefill_cpu_s(stack.url) - cpu0
    turns = [t for conv in conversations for t in conv]
    summary = summarize([t.timing for t in turns], wall)
    ttft = [t.timing.ttft_s * 1000 for t in turns if t.timing.ok]
    by_turn = [
        percentile([conv[k].timing.ttft_s * 1000 for conv in conversations], 50)
        for k in range(cfg.turns)
    ]
    return {
        "prefix_cache": cache,
        "requests": summary.requests,
        "completed": summary.completed,
        "wall_s": wall,
        "output_tokens": summary.output_tokens,
        "output_tok_s": summary.output_tok_s,
        "ttft_p50_ms": percentile(ttft, 50) if ttft else None,
        "ttft_p99_ms": percentile(ttft, 99) if ttft else None,
        "ttft_p50_ms_by_turn": by_turn,
        "prefill_core_s": prefill_cpu,
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "cached_tokens": sum(t.cached_tokens for t in turns),
        "errors": list(summary.errors),
        "answers": [[t.text for t in conv] for conv in conversations],
    }


async def _warm(url: str) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as c:
        await _turn(c, url, list(range(3, 40)), 2)


def run(cfg: SharedPrefixConfig) -> dict:
    on = run_setting(cfg, cache=True)
    off = run_setting(cfg, cache=False)
    same = on.pop("answers") == off.pop("answers")
    ratios = {}
    if on["ttft_p50_ms"] and off["ttft_p50_ms"]:
        ratios["ttft_p50_off_over_on"] = off["ttft_p50_ms"] / on["ttft_p50_ms"]
        ratios["ttft_p99_off_over_on"] = off["ttft_p99_ms"] / on["ttft_p99_ms"]
    if off["output_tok_s"]:
        ratios["throughput_on_over_off"] = on["output_tok_s"] / off["output_tok_s"]
    if on["prefill_core_s"]:
        ratios["prefill_core_s_off_over_on"] = off["prefill_core_s"] / on["prefill_core_s"]
    return {
        "bench": "serve-shared-prefix",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "config": asdict(cfg),
        "results": [on, off],
        "same_answers_on_and_off": same,
        "ratios": ratios,
    }


def plot(report: dict, path: str) -> None:
    """TTFT p50 per turn, and the headline numbers, cache on against off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    on, off = report["results"]
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(13, 4.5))
    turns = range(1, len(on["ttft_p50_ms_by_turn"]) + 1)
    for row, color in ((on, "C0"), (off, "C1")):
        label = "prefix cache on" if row["prefix_cache"] else "prefix cache off"
        ax_t.plot(turns, row["ttft_p50_ms_by_turn"], marker="o", color=color, label=label)
    ax_t.set_xlabel("turn of the conversation")
    ax_t.set_ylabel("TTFT p50 (ms)")
    ax_t.set_xticks(list(turns))
    ax_t.set_title("TTFT p50 by turn")
    ax_t.grid(True, alpha=0.3)
    ax_t.legend()
    names = [
        "TTFT p50\noff / on",
        "TTFT p99\noff / on",
        "output tok/s\non / off",
        "prefill core-s\noff / on",
    ]
    gains = [
        (off["ttft_p50_ms"] or 0) / (on["ttft_p50_ms"] or 1),
        (off["ttft_p99_ms"] or 0) / (on["ttft_p99_ms"] or 1),
        on["output_tok_s"] / (off["output_tok_s"] or 1),
        off["prefill_core_s"] / (on["prefill_core_s"] or 1),
    ]
    xs = range(len(names))
    ax_b.bar(xs, gains, color="C0")
    for x, g in zip(xs, gains, strict=True):
        ax_b.text(x, g, f"{g:.2f}x", ha="center", va="bottom")
    ax_b.axhline(1.0, color="k", lw=0.8)
    ax_b.set_xticks(list(xs), names)
    ax_b.set_ylabel("gain with the prefix cache (x)")
    ax_b.set_title("what the cache gains (> 1: better with it)")
    c = report["config"]
    fig.suptitle(
        f"shared-prefix: {c['users']} users x {c['turns']} turns, {c['system_tokens']}-token "
        f"system prompt, {c['max_tokens']} output tokens ({c['model']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
