"""`make soak`: mixed load on the local stack with periodic worker kills; writes a report.

    .venv/bin/python loadtest/soak.py [--duration 600] [--kill-every 60] [--users 6]
        [--mix plain|chaos] [--model models/demo] [--out benchmarks/soak]

Starts `tpla serve` (two decode groups, two prefill workers, embedded Redis) on free loopback
ports, runs `--users` client threads that each send one request after another of the mix
(loadtest/mix.py: `plain` chat turns, or the `chaos` mix of n > 1, structured outputs, named
tools and shared system prompts), and every `--kill-every` seconds (0: never) kill -9s one
process in turn: a decode follower rank, a prefill worker, a decode leader. Every 10 s it
records each process's RSS. When the time is up the load stops, the stack gets up to 2
minutes to recover, and the report counts:

    sent / completed / failed (a clean error: an OpenAI error body, or an SSE error event
    followed by [DONE]; 503s among them counted apart) / lost (no answer within the client
    timeout, a dropped connection, a stream without [DONE]) / invalid (a structured answer
    that finished with "stop" but does not validate) and leaked KV blocks (in use on a
    decode leader once idle).

Writes OUT.json and OUT.md (and OUT_rss.png). Exits non-zero when lost, invalid or leaked
is above 0. Every client request has a hard timeout and the run a fixed duration: it always
ends.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest.mix import MIXES, send  # noqa: E402
from tools.local_stack import LocalStack  # noqa: E402

CLIENT_TIMEOUT_S = 120.0
RSS_EVERY_S = 10.0
RECOVER_TIMEOUT_S = 120.0
VICTIMS = ("decode-follower", "prefill", "decode-leader")


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    counts: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    lost_examples: list[str] = field(default_factory=list)

    def add(self, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.counts[outcome] += 1
            if outcome == "failed":
                self.errors[detail[:80]] += 1
            if outcome in ("lost", "invalid") and len(self.lost_examples) < 10:
                self.lost_examples.append(f"{outcome}: {detail[:300]}")


def user(url: str, mix: str, model: str, seed: int, stop: threading.Event, tally: Tally) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        tally.add("sent")
        req = MIXES[mix](rng, model)
        answer = send(url, req, CLIENT_TIMEOUT_S)
        tally.add(answer.outcome, f"{answer.status} {answer.detail}")
        if answer.status == 503:
            tally.add("unavailable")
        if bad := answer.invalid(req):
            tally.add("invalid", f"{req.body} -> {bad}")
        if answer.outcome == "failed":
            time.sleep(0.5)  # a client backs off after an error


def pick_victim(stack: LocalStack, kind: str) -> tuple[str, int] | None:
    ws = stack.workers()
    if kind == "prefill":
        cands = [w for w in ws if w["role"] == "prefill"]
    else:
        rank = 0 if kind == "decode-leader" else 1
        cands = [w for w in ws if w["role"] == "decode" and w["rank"] == rank]
    if not cands:
        return None
    w = max(cands, key=lambda w: w.get("kv_blocks_used") or w.get("queued_tokens") or 0)
    return w["worker_id"], w["pid"]


def role_of(proc: psutil.Process) -> str:
    cmd = " ".join(proc.cmdline())
    if "redis-server" in cmd:
        return "redis"
    if "services.decode.group.follower" in cmd:
        return "decode-follower"
    for role in ("decode", "prefill", "router"):
        if f"tools.cli {role}" in cmd:
            return "decode-leader" if role == "decode" else role
    return proc.name()


def sample_rss(stack: LocalStack, t0: float) -> dict:
    per_role: dict[str, list[float]] = {}
    for p in psutil.Process(stack.proc.pid).children(recursive=True):
        try:
            per_role.setdefault(role_of(p), []).append(p.memory_info().rss / 2**20)
        except psutil.NoSuchProcess:
            continue
    return {"t": round(time.monotonic() - t0, 1), "rss_mb": per_role}


def wait_idle(stack: LocalStack, groups: int, prefill: int) -> tuple[bool, int]:
    """(recovered, KV blocks still in use on the decode leaders) after the load stopped."""
    deadline = time.monotonic() + RECOVER_TIMEOUT_S
    used = -1
    while time.monotonic() < deadline:
        try:
            ws = stack.workers()
        except httpx.HTTPError:
            time.sleep(1)
            continue
        leaders = [w for w in ws if w["role"] == "decode" and w["rank"] == 0]
        healthy = all(w["healthy"] for w in ws if w["role"] == "decode")
        used = sum(w["kv_blocks_used"] for w in leaders)
        n_prefill = sum(w["role"] == "prefill" for w in ws)
        if len(leaders) == groups and healthy and n_prefill == prefill and used == 0:
            return True, 0
        time.sleep(1)
    return False, used


def run(args: argparse.Namespace) -> dict:
    groups, prefill = 2, 2
    model_name = "tpla-demo"
    stack = LocalStack.start(
        args.model,
        SERVED_MODEL_NAME=model_name,
        DECODE_GROUPS=str(groups),
        PREFILL_WORKERS=str(prefill),
        HEARTBEAT_S="0.5",
        WORKER_TTL_S="3",
        KV_BUDGET_MB="64",
    )
    tally, stop = Tally(), threading.Event()
    kills: list[dict] = []
    rss: list[dict] = []
    t0 = time.monotonic()
    try:
        threads = [
            threading.Thread(target=user, args=(stack.url, args.mix, model_name, i, stop, tally))
            for i in range(args.users)
        ]
        for t in threads:
            t.start()
        never = float("inf")
        next_kill = t0 + args.kill_every if args.kill_every > 0 else never
        next_rss, turn = t0, 0
        while (now := time.monotonic()) < t0 + args.duration:
            if now >= next_rss:
                rss.append(sample_rss(stack, t0))
                next_rss += RSS_EVERY_S
            if now >= next_kill:
                kind = VICTIMS[turn % len(VICTIMS)]
                victim = pick_victim(stack, kind)
                if victim is not None:
                    os.kill(victim[1], signal.SIGKILL)
                    kills.append({"t": round(now - t0, 1), "kind": kind, "worker": victim[0]})
                    print(f"[{now - t0:6.0f} s] killed {kind} {victim[0]}", flush=True)
                turn += 1
                next_kill += args.kill_every
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(timeout=CLIENT_TIMEOUT_S + 10)
        hung = sum(t.is_alive() for t in threads)
        recovered, leaked = wait_idle(stack, groups, prefill)
        rss.append(sample_rss(stack, t0))
        final = httpx.get(f"{stack.url}/metrics", timeout=10).text
    finally:
        stack.stop()
    migrations = sum(
        float(line.split()[-1])
        for line in final.splitlines()
        if line.startswith("tpla:request_migrations_total")
    )
    c = tally.counts
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "duration_s": args.duration,
        "kill_every_s": args.kill_every,
        "users": args.users,
        "mix": args.mix,
        "model": os.path.relpath(args.model, ROOT),
        "machine": f"{os.cpu_count()} cores, CPU only",
        "sent": c["sent"],
        "completed": c["completed"],
        "failed": c["failed"],
        "unavailable": c["unavailable"],
        "invalid": c["invalid"],
        "lost": c["lost"] + hung,
        "leaked_blocks": leaked,
        "recovered": recovered,
        "migrations": migrations,
        "kills": kills,
        "errors": dict(tally.errors.most_common(10)),
        "lost_examples": tally.lost_examples,
        "rss": rss,
    }


def _table(header: list[str], row: list[object]) -> str:
    return "\n".join(
        "| " + " | ".join(map(str, cells)) + " |" for cells in (header, ["---"] * len(header), row)
    )


def write_report(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    first, last = report["rss"][0]["rss_mb"], report["rss"][-1]["rss_mb"]
    rows = "\n".join(
        f"| {role} | {', '.join(f'{x:.0f}' for x in first.get(role, []))} | "
        f"{', '.join(f'{x:.0f}' for x in last.get(role, []))} |"
        for role in sorted(set(first) | set(last))
    )
    kills = Counter(k["kind"] for k in report["kills"])
    table = _table(
        [
            "sent",
            "completed",
            "failed (clean error)",
            "of them 503",
            "**lost**",
            "**invalid**",
            "**leaked KV blocks**",
            "migrations",
            "recovered",
        ],
        [
            report["sent"],
            report["completed"],
            report["failed"],
            report["unavailable"],
            f"**{report['lost']}**",
            f"**{report['invalid']}**",
            f"**{report['leaked_blocks']}**",
            f"{report['migrations']:.0f}",
            report["recovered"],
        ],
    )
    errors = "\n".join(f"- {n} x `{e}`" for e, n in report["errors"].items()) or "- none"
    out.with_suffix(".md").write_text(
        f"""# Soak: mixed load with periodic worker kills

Command: `.venv/bin/python loadtest/soak.py --duration {report["duration_s"]:g}
--kill-every {report["kill_every_s"]:g} --users {report["users"]} --mix {report["mix"]}`
(`make soak`: 600 s, 60 s, 6 users, plain), {report["date"]},
{report["machine"]}, model `{report["model"]}`: 2 decode groups (TPLA tp=2 r=2) + 2 prefill
workers + router + embedded Redis, all on this machine.

{table}

Kills (kill -9, one every {report["kill_every_s"]:g} s; 0: none): {dict(kills)}.

Clean errors seen (most common first):
{errors}

RSS per process (MiB), first sample vs after the run (a restarted process starts afresh):

| process | start | end |
|---|---|---|
{rows}

Full time series in `{out.with_suffix(".json").name}`; plot in `{out.name}_rss.png`.
"""
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    roles = sorted({r for s in report["rss"] for r in s["rss_mb"]})
    for role in roles:
        ts = [s["t"] for s in report["rss"] if role in s["rss_mb"]]
        ys = [sum(s["rss_mb"][role]) for s in report["rss"] if role in s["rss_mb"]]
        ax.plot(ts, ys, label=role)
    for k in report["kills"]:
        ax.axvline(k["t"], color="grey", lw=0.5, ls=":")
    ax.set_xlabel("seconds (dotted: a kill -9)")
    ax.set_ylabel("RSS, MiB (sum per role)")
    ax.set_title("Soak: memory per process role under load and kills")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.parent / f"{out.name}_rss.png", dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--kill-every", type=float, default=60.0, help="0: no kills")
    ap.add_argument("--mix", choices=sorted(MIXES), default="plain")
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--model", default=str(ROOT / "models" / "demo"))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "soak")
    args = ap.parse_args()
    report = run(args)
    write_report(report, args.out)
    keys = ("sent", "completed", "failed", "unavailable", "invalid", "lost", "leaked_blocks")
    print(json.dumps({k: report[k] for k in keys}), flush=True)
    return 0 if report["lost"] == report["invalid"] == report["leaked_blocks"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
