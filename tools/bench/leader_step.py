"""`tpla bench leader-step`: the decode leader's host work per step, and each rank's, against
batch and context.

What runs is the engine's own code: the scheduler and block pools (services/decode/leader),
the step's plan (`DecodePlans.step`: rows, table edits) sent over a real rank group (gloo,
tp = 2, two processes), and on every rank the plan received and its edits applied to the
rank's kept tables (`RankTables.apply`). The stand-in is the pool: a V3-shaped group's
(block size 16, 128K positions, TPLA r = 2) block ids without KV memory behind them, and no
model: the ranks apply the plan, gather the step's tables (the device work the step does
first) and answer with their times instead of logits. So what is measured is the plan's
cost, not a step's.

Every sequence holds `context` tokens. Steps alternate between steady ones (the batch as it
was) and churn ones (one sequence finishes, a new one joins: its whole table goes with that
step, once). Each row reports the medians of each kind: the leader's plan build + send, the
bytes sent, each rank's apply (receive excluded) and its table gather; and, for scale, what
building the previous plan (every table in full, every step) took on the same batch.

`--json` prints only JSON on stdout; the table goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import platform
import statistics
import time
from dataclasses import dataclass

import torch

from common.group.child import end_process
from common.group.comm import Comm
from common.group.setup import init_group, open_comm
from common.kv.block_pool import RankPools
from common.parallel import ParallelConfig
from common.runtime.ports import free_port
from services.decode.config import EngineConfig
from services.decode.group.spec import group_spec
from services.decode.leader.decode_plans import DecodePlans
from services.decode.leader.scheduler import DecodeSequence, Scheduler
from services.decode.leader.verify import StepRows
from services.decode.rank.block_tables import RankTables
from services.decode.step_plan import DecodePlan, PingPlan, plan_bytes, recv_plan, send_plan
from tools.bench.output import table_stream

BLOCK_SIZE = 16  # DeepSeek-V3 deployments' (k8s/base)
POSITIONS = 131072  # the context limit: 128K positions
TP = 2
STEPS = 24  # per (batch, context): half steady, half churn
HEADROOM = STEPS + 4  # tokens each sequence may still generate


@dataclass(frozen=True)
class LeaderStepRow:
    batch: int
    context: int  # tokens each sequence holds (the longest leaves room for the steps' tokens)
    leader_ms: float  # plan build + send, steady steps (median)
    leader_churn_ms: float  # the same, steps where one sequence leaves and one joins
    bytes_per_step: int  # header + payload, steady steps
    bytes_churn_step: int
    rank_apply_ms: float  # the most any rank took to apply its edits, steady (median)
    rank_apply_churn_ms: float
    rank_gather_ms: float  # the step's tables gathered from the kept ones (device work)
    full_tables_build_ms: float  # building the previous plan's full tables, for scale


def _config(max_batch: int, port: int) -> EngineConfig:
    return EngineConfig(
        model="unused",
        parallel=ParallelConfig(tp=TP, latent_groups=TP),
        block_size=BLOCK_SIZE,
        max_batch=max_batch,
        max_model_len=POSITIONS,
        collectives="dist",
        master_port=port,
        collective_timeout_s=120,
    )


def _rank(cfg_json: str, rank: int) -> None:
    """A follower rank: every plan received, its edits applied, its tables gathered; it
    answers each step with its two times (seconds) instead of logits."""
    cfg = EngineConfig.from_json(cfg_json)
    spec = group_spec(cfg)
    init_group(spec, rank)
    comm = open_comm(spec, rank, torch.device("cpu"))
    max_blocks = -(-POSITIONS // BLOCK_SIZE)
    tables = RankTables(cfg.max_batch, max_blocks, 0, torch.device("cpu"))
    while (plan := recv_plan(comm)) is not None:
        if isinstance(plan, PingPlan):  # the end of one (batch, context): fresh tables
            tables = RankTables(cfg.max_batch, max_blocks, 0, torch.device("cpu"))
            continue
        assert isinstance(plan, DecodePlan)
        comm.gather(_apply(tables, plan))
    end_process(0)


def _apply(tables: RankTables, plan: DecodePlan) -> torch.Tensor:
    t0 = time.perf_counter()
    tables.apply(plan.edits)
    t1 = time.perf_counter()
    tables.rows(plan.slots, plan.width)
    return torch.tensor([t1 - t0, time.perf_counter() - t1], dtype=torch.float64)


def _full_tables(pools: RankPools, batch: list[DecodeSequence]) -> torch.Tensor:
    """The previous plan's tables: every sequence's whole table from the pools' lists,
    padded to the step's width."""
    width = max(-(-(s.next_position + 1) // BLOCK_SIZE) for s in batch)
    pad = [-1] * width
    rows = []
    for seq in batch:
        table = pools.tables(seq.seq_id)[0]
        rows.append([*table[:width], *pad[: max(width - len(table), 0)]])
    return torch.tensor([rows], dtype=torch.int64)


class _Group:
    """The leader's side: its scheduler and plans over a block-id-only pool, its rank 0's
    kept tables, and the follower that receives every plan."""

    def __init__(self, cfg: EngineConfig, batch: int, context: int) -> None:
        per_seq = -(-(context + HEADROOM) // BLOCK_SIZE)
        self.pools = RankPools((batch + 1) * per_seq, BLOCK_SIZE, cfg.parallel)
        self.scheduler = Scheduler(self.pools, cfg.max_batch, POSITIONS)
        self.plans = DecodePlans(self.scheduler, cfg, bucketed=False)
        self.tables = RankTables(cfg.max_batch, self.plans.max_blocks, 0, torch.device("cpu"))
        self.context, self.joined = context, 0
        self.built: list[float] = []  # each step's plan build alone (seconds)

    def admit(self) -> None:
        rid = f"seq-{self.joined}"
        self.joined += 1
        # The sequence's context counts its first token: prompt + 1 = context.
        self.scheduler.reserve(rid, self.context - 1, HEADROOM, float("inf"))
        self.scheduler.start(rid, 1)

    def step(self, comm: Comm, churn: bool) -> tuple[float, int, list[float], list[float]]:
        """One step: (leader seconds, bytes sent, each rank's apply and gather seconds)."""
        sched = self.scheduler
        if churn:
            sched.finish(sched.running[0])
            self.admit()
        batch = sched.schedule()
        rows = StepRows([[] for _ in batch])
        t0 = time.perf_counter()
        plan = self.plans.step(batch, rows)
        self.built.append(time.perf_counter() - t0)
        send_plan(plan, comm)
        leader = time.perf_counter() - t0
        mine = _apply(self.tables, plan)
        times = comm.gather(mine)
        assert times is not None  # rank 0
        for seq in batch:  # a token each, as sampling would append
            sched.append(seq.seq_id, 2, finished=False)
        return leader, plan_bytes(plan), times[:, 0].tolist(), times[:, 1].tolist()


def _measure(cfg: EngineConfig, comm: Comm, batch: int, context: int) -> LeaderStepRow:
    group = _Group(cfg, batch, context)
    for _ in range(batch):
        group.admit()
    group.step(comm, churn=False)  # every table crosses once: not a step like the others
    kinds: dict[bool, list[tuple[float, int, list[float], list[float]]]] = {False: [], True: []}
    for i in range(STEPS):
        churn = i % 2 == 1
        kinds[churn].append(group.step(comm, churn))
    t0 = time.perf_counter()
    _full_tables(group.pools, group.scheduler.schedule())
    full = time.perf_counter() - t0
    send_plan(PingPlan(), comm)  # the follower starts afresh

    def med(values: list[float]) -> float:
        return 1000 * statistics.median(values)

    steady, churn = kinds[False], kinds[True]
    return LeaderStepRow(
        batch,
        context,
        med([s[0] for s in steady]),
        med([s[0] for s in churn]),
        int(statistics.median(s[1] for s in steady)),
        int(statistics.median(s[1] for s in churn)),
        med([max(s[2]) for s in steady]),
        med([max(s[2]) for s in churn]),
        med([max(s[3]) for s in steady]),
        1000 * full,
    )


def measure(batches: list[int], contexts: list[int]) -> list[LeaderStepRow]:
    """Every (batch, context) on one gloo group of TP ranks: this process and a follower."""
    if max(contexts) > POSITIONS or min(contexts) < 2:
        raise ValueError(f"contexts must lie in [2, {POSITIONS}]")
    cfg = _config(max(batches), free_port())
    ctx = mp.get_context("spawn")
    follower = ctx.Process(target=_rank, args=(cfg.to_json(), 1), daemon=True)
    follower.start()
    spec = group_spec(cfg)
    init_group(spec, 0)
    comm = open_comm(spec, 0, torch.device("cpu"))
    rows = []
    try:
        for context in contexts:
            for batch in batches:
                # The longest leaves each sequence room for the steps' tokens.
                rows.append(_measure(cfg, comm, batch, min(context, POSITIONS - HEADROOM)))
        send_plan(None, comm)
    finally:
        follower.join(timeout=30)
        if follower.is_alive():
            follower.kill()
    return rows


def machine() -> str:
    """The CPU this ran on, as /proc/cpuinfo names it (else the platform's word)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({mp.cpu_count()} CPUs)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cmd_leader_step(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    rows = measure(args.batch, args.context)
    out = table_stream(args.json)
    print(
        f"{'batch':>6} {'context':>8} {'leader ms':>10} {'churn ms':>9} {'bytes':>7} "
        f"{'churn B':>8} {'apply ms':>9} {'churn ms':>9} {'gather ms':>10} {'full-table ms':>14}",
        file=out,
    )
    for r in rows:
        print(
            f"{r.batch:>6} {r.context:>8} {r.leader_ms:>10.3f} {r.leader_churn_ms:>9.3f} "
            f"{r.bytes_per_step:>7} {r.bytes_churn_step:>8} {r.rank_apply_ms:>9.3f} "
            f"{r.rank_apply_churn_ms:>9.3f} {r.rank_gather_ms:>10.3f} "
            f"{r.full_tables_build_ms:>14.2f}",
            file=out,
        )
    if args.json:
        info = {"machine": machine(), "tp": TP, "block_size": BLOCK_SIZE, "positions": POSITIONS}
        print(json.dumps({**info, "rows": [dataclasses.asdict(r) for r in rows]}))
    return 0


def add_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bsub.add_parser("leader-step", help="the decode leader's plan per step vs batch, context")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128, 256])
    p.add_argument("--context", type=int, nargs="+", default=[1024, 32768, 131072])
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_leader_step)
