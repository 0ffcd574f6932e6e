"""What every decode rank runs: its config, its model share and KV pool, and its step.

The leader (rank 0) and follower ranks share `RankRuntime`; only the leader schedules. A
follower is a separate OS process: one the leader spawned runs `python -m
services.decode.rank.runtime RANK LEADER_PID` with the leader's config as JSON in
TPLA_ENGINE_CONFIG (nothing but JSON and tensors crosses a process boundary); a rank started
on its own (`tpla decode --rank K`) builds its config from its settings. Both then join the
group the same way (services/decode/group/join.py) and run `follower_main`.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist
from torch import Tensor

from common.kv.chunks import chunk_owner, local_index, local_length
from common.kv.paged_cache import CacheReads, PagedLatentCache
from common.kv.receiver import KvReceiverServicer, ShardTarget, add_kv_receiver
from common.kv.slots import token_slots
from common.kv.wire import TransferError, shard_slots
from common.loading.serving_model import open_serving_weights
from common.model.tpla import latent_shards
from common.native import shm_group
from common.native.shm_group import CollectiveError, ShmGroup
from common.rpc.clients import CHANNEL_OPTIONS
from common.rpc.gen import kv_pb2
from common.runtime import group_files
from common.runtime.device import rank_device
from common.runtime.ports import bind_grpc, check_ports, kv_receiver_ports
from services.decode.config import EngineConfig
from services.decode.group.comm import Comm, DistCollectives, ShmCollectives
from services.decode.group.join import FollowerGroup
from services.decode.group.step_plan import CopyPlan, DecodePlan, PingPlan, WritePlan, recv_plan
from services.decode.rank.backends import select_decode_backend
from services.decode.rank.model import RankModel

log = logging.getLogger(__name__)


class RankRuntime:
    """One rank's model share and KV pool on its device; `step` runs a decode plan."""

    def __init__(self, cfg: EngineConfig, rank: int) -> None:
        self.cfg, self.rank = cfg, rank
        self.device = rank_device(cfg.device, cfg.local_index(rank))
        torch.set_num_threads(cfg.torch_threads)
        # Only this rank's share is read from the checkpoint, straight onto its device.
        weights, spectra = open_serving_weights(cfg.model, cfg.reparam, cfg.dtype, self.device)
        r = cfg.parallel.latent_groups
        shards = [latent_shards(weights.config.kv_lora_rank, r, s) for s in spectra]
        self.model = RankModel(weights, cfg.parallel, rank, shards)
        dtype = getattr(torch, cfg.dtype)
        self.model.place(self.device)
        self.model.use_backend(select_decode_backend(cfg.decode_kernel, self.device, dtype))
        self.layout = self.model.cache_layout(cfg.block_size, dtype)
        num_blocks = self.layout.blocks_for_budget(int(cfg.kv_budget_mb * 2**20))
        self.cache = PagedLatentCache(self.layout, num_blocks, self.device)
        self.comm = open_comm(cfg, rank, self.device)
        self.inputs = StepInputs(self.device)

    def step(self, plan: DecodePlan) -> Tensor:
        """Run one decode step; returns this rank's padded logits slice [B, V/tp]."""
        bs, par = self.cfg.block_size, self.cfg.parallel
        host_positions = plan.positions  # sizes the reads without waiting for the device
        plan = self.inputs.load(plan)
        positions = plan.positions
        tables = plan.block_tables[self.rank if plan.block_tables.shape[0] > 1 else 0]
        if par.sp:
            # This rank caches only its chunks: local lengths, and the new token only if owned.
            c = par.chunk_size
            lengths = local_length(positions + 1, self.rank, c, par.tp)
            local = local_index(positions, c, par.tp)
            owned = chunk_owner(positions, c, par.tp) == self.rank
            # Non-owned rows may index past this rank's table (token_slots clamps): mask them.
            write_slots = token_slots(tables, local[:, None], bs)[:, 0]
            write_slots = torch.where(owned, write_slots, torch.full_like(write_slots, -1))
            reads = CacheReads.tokens(tables, lengths, bs)
        else:
            write_slots = token_slots(tables, positions[:, None], bs)[:, 0]
            longest = int(host_positions.max()) + 1
            reads = CacheReads.blocks(tables, positions + 1, bs, longest)
        return self.model.decode_step(
            plan.tokens, positions, write_slots, reads, self.cache, self.comm
        )

    def shard_target(self, header: kv_pb2.KvHeader) -> ShardTarget:
        """KV receiver sink: validate a transferred shard's header; the receiver then writes
        the shard into its blocks as it arrives.

        Safe beside the step loop: the blocks belong to a reservation that is not running.
        """
        lay = self.layout
        if header.rank != self.rank:
            raise TransferError(f"shard for rank {header.rank} sent to rank {self.rank}")
        if (header.num_layers, header.latent_width, header.rope_width) != (
            lay.num_layers,
            lay.latent_width,
            lay.rope_width,
        ):
            raise TransferError(
                f"shard shape (L={header.num_layers}, w={header.latent_width}, "
                f"d_r={header.rope_width}) does not match this rank's cache (L={lay.num_layers}, "
                f"w={lay.latent_width}, d_r={lay.rope_width})"
            )
        if header.block_size != lay.block_size:
            raise TransferError(f"block size {header.block_size} != {lay.block_size}")
        slots = shard_slots(header)
        if len(slots) and int(slots.max()) >= self.cache.num_blocks * lay.block_size:
            raise TransferError("shard addresses blocks outside this rank's pool")
        return ShardTarget(self.cache, slots)

    def start_kv_receiver(self) -> grpc.Server | None:
        """Serve KvReceiver (and a TCPStore for the torch transport) for this rank."""
        if self.cfg.kv_port_base is None:
            return None
        host = self.cfg.host
        grpc_use, store_use = kv_receiver_ports(
            self.cfg.kv_port_base, self.rank, index=self.cfg.local_index(self.rank)
        )
        # A taken port is PortInUse, named with its setting, not an error in c10d's words.
        check_ports(host, [store_use])
        try:
            store = dist.TCPStore(
                host,
                store_use.port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=self.cfg.collective_timeout_s),
            )
        except dist.DistNetworkError:
            check_ports(host, [store_use])
            raise
        server = grpc.server(ThreadPoolExecutor(max_workers=16), options=CHANNEL_OPTIONS)
        self.receiver = KvReceiverServicer(
            self.shard_target, store, self.cfg.internal_token, device=self.device
        )
        add_kv_receiver(self.receiver, server)
        bind_grpc(server, host, grpc_use)
        server.start()
        self._store = store  # keep the TCPStore server alive with the receiver
        return server

    def copy_blocks(self, plan: CopyPlan) -> None:
        """This rank's part of a block copy (forks of a prompt: see Scheduler)."""
        pairs = plan.rank_pairs(self.rank).to(self.device)
        if len(pairs):
            self.cache.copy_blocks(pairs[:, 0], pairs[:, 1])

    def receive_write(self, plan: WritePlan) -> None:
        """Follower side of a local KV write: receive the shard from the leader."""
        if plan.target != self.rank:
            return
        lay, n = self.layout, len(plan.slots)
        lat = torch.empty(lay.num_layers, n, lay.latent_width, dtype=lay.dtype, device=self.device)
        rope = torch.empty(lay.num_layers, n, lay.rope_width, dtype=lay.dtype, device=self.device)
        self.comm.recv(lat, 0)
        self.comm.recv(rope, 0)
        self.cache.write_all_layers(plan.slots.to(self.device), lat, rope)


class StepInputs:
    """A decode plan's tensors on the rank's device, through buffers made once.

    On a GPU the plan (CPU tensors from the control group) is packed into pinned host
    memory and copied asynchronously into a device buffer that later steps reuse; two host
    buffers alternate, each reused only after its previous copy finished. On the CPU the
    plan's tensors are the step's inputs as they are.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: list[Tensor] = []
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._device_words = torch.empty(0, dtype=torch.int64, device=device)
        self._turn = 0

    def load(self, plan: DecodePlan) -> DecodePlan:
        if self.device.type == "cpu":
            return plan
        b = len(plan.tokens)
        words = 2 * b + plan.block_tables.numel()
        if self._device_words.numel() < words:
            size = max(words, 2 * self._device_words.numel())
            self._host = [torch.empty(size, dtype=torch.int64).pin_memory() for _ in range(2)]
            self._done = [None, None]
            self._device_words = torch.empty(size, dtype=torch.int64, device=self.device)
        turn = self._turn
        self._turn ^= 1
        if (done := self._done[turn]) is not None:
            done.synchronize()
        host = self._host[turn][:words]
        torch.cat([plan.tokens, plan.positions, plan.block_tables.flatten()], out=host)
        dev = self._device_words[:words]
        dev.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._done[turn] = event
        return DecodePlan(dev[:b], dev[b : 2 * b], dev[2 * b :].view(plan.block_tables.shape))


def init_group(cfg: EngineConfig, rank: int, store: dist.Store | None = None) -> None:
    """Join the group's torch.distributed default group: gloo, the CPU control group (and
    point-to-point transfers on the CPU); `open_comm` adds NCCL for a GPU group's data. The
    rendezvous is the group's store (services/decode/group/join.py), else a tcp:// one on the
    leader's port."""
    if cfg.parallel.tp == 1:
        return
    device = rank_device(cfg.device, cfg.local_index(rank))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=cfg.collective_timeout_s)
    if store is None:
        init = {"init_method": f"tcp://{cfg.master_addr}:{cfg.master_port}"}
    else:
        init = {"store": dist.PrefixStore("tpla/pg", store)}
    dist.init_process_group("gloo", world_size=cfg.parallel.tp, rank=rank, timeout=timeout, **init)


# Each rank's slot in the group file; larger messages (a big batch's logits) go in rounds.
SHM_SLOT_BYTES = 4 * 2**20


def create_shm_group(cfg: EngineConfig) -> str | None:
    """Leader, before starting its followers: make the group's shared-memory file, or None
    (tp = 1, "dist" asked for, or no native library here: torch.distributed it is)."""
    if cfg.collectives != "shm" or cfg.parallel.tp == 1:
        return None
    if not shm_group.available():
        return None
    path = group_files.new_path()
    try:
        group = ShmGroup(path, 0, cfg.parallel.tp, SHM_SLOT_BYTES, cfg.collective_timeout_s, True)
    except CollectiveError as exc:  # e.g. /dev/shm too small: gloo still works
        group_files.remove(path)  # an attach that failed after the file was made
        log.warning("shared-memory collectives unavailable, using torch.distributed: %s", exc)
        return None
    group.close()
    return path


def open_shm_group(cfg: EngineConfig, rank: int) -> ShmGroup | None:
    if cfg.shm_path is None or cfg.parallel.tp == 1:
        return None
    return ShmGroup(
        cfg.shm_path, rank, cfg.parallel.tp, SHM_SLOT_BYTES, cfg.collective_timeout_s, False
    )


def open_comm(cfg: EngineConfig, rank: int, device: torch.device) -> Comm:
    """The rank's control group (shared memory, else gloo) and data group (the same on the
    CPU; NCCL, created here by every rank alike, on GPUs)."""
    if cfg.parallel.tp == 1:
        return Comm(1)
    default = DistCollectives()
    shm = open_shm_group(cfg, rank)
    control = default if shm is None else ShmCollectives(shm, default)
    if device.type == "cuda":
        return Comm(cfg.parallel.tp, control, DistCollectives(dist.new_group(backend="nccl")))
    return Comm(cfg.parallel.tp, control, control)


def exit_with_parent(parent: int | None = None, on_exit: Callable[[], None] | None = None) -> None:
    """A child process (a follower rank, a bench receiver) whose parent died must not linger
    in a collective or on its ports until a timeout: exit as soon as the parent is gone.

    `parent`: the pid that started this process (default: the parent now). A follower passes
    its leader's, which may have died while the follower was still importing. `on_exit` runs
    first (a follower removes its group's file: a leader killed with SIGKILL cannot)."""
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        if on_exit is not None:
            on_exit()
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def follower_main(cfg: EngineConfig, rank: int, leader: int | None = None) -> int:
    """A follower rank: join the group, execute the leader's plans until shutdown; the exit
    code. `leader`: the pid of the leader that spawned this process (None: started on its own).

    Until the start-up barrier a spawned group's file has a name: a follower that fails to
    start, or sees its leader gone, removes it, since the group cannot start. A start-up
    error of its configuration (a port in use, a config that differs from the leader's) is
    one line on stderr, reported to the leader through the group's store, and
    START_ERROR_EXIT."""
    remove_file = (lambda: group_files.remove(cfg.shm_path)) if cfg.shm_path else None
    if leader is not None:
        exit_with_parent(leader, remove_file)
    group: FollowerGroup | None = None
    try:
        group = FollowerGroup.join(cfg, rank, remove_file)
        init_group(cfg, rank, group.store)
        runtime = RankRuntime(cfg, rank)
        receiver = runtime.start_kv_receiver()
        group.publish_endpoints(*(cfg.kv_addresses(rank) if receiver else ("", "")))
        runtime.comm.barrier()  # the leader waits until every rank has loaded its share
        if leader is None:
            kv = cfg.kv_addresses(rank)[0] if receiver else "none"
            print(
                f"decode rank {rank} of {cfg.parallel.tp} joined the group at "
                f"{group.address} (KV receiver {kv})",
                flush=True,
            )
    except BaseException as exc:
        if remove_file is not None:
            remove_file()
        if isinstance(exc, ValueError | FileNotFoundError):  # as tools/cli/main.py main
            if group is not None:
                group.report(str(exc))
            print(f"decode rank {rank}: error: {exc}", file=sys.stderr, flush=True)
            return START_ERROR_EXIT
        raise
    try:
        run_plans(runtime)
    except RuntimeError:  # a collective broke (gloo's closed connection, CollectiveError)
        if group.leader_alive():
            raise  # this rank's own failure: its traceback
        group.end()
        group.leader_gone()
        return 1
    group.end()
    if receiver is not None:
        receiver.stop(grace=1)
    dist.destroy_process_group()
    return 0


def run_plans(runtime: RankRuntime) -> None:
    """Execute the leader's plans until its shutdown plan."""
    while True:
        plan = recv_plan(runtime.comm)
        if plan is None:
            return
        if isinstance(plan, DecodePlan):
            runtime.comm.gather(runtime.step(plan))  # to the leader, which samples
        elif isinstance(plan, PingPlan):
            continue
        elif isinstance(plan, CopyPlan):
            runtime.copy_blocks(plan)
        else:
            runtime.receive_write(plan)


# The leader hands a follower its config in the environment, not on the command line: the
# config holds the internal token, and any local user can read a process's arguments.
CONFIG_ENV = "TPLA_ENGINE_CONFIG"
# A follower's exit code after printing a configuration error (`tpla`'s, tools/cli/main.py).
START_ERROR_EXIT = 2

if __name__ == "__main__":
    # python -m services.decode.rank.runtime RANK LEADER_PID
    sys.exit(
        follower_main(
            EngineConfig.from_json(os.environ.pop(CONFIG_ENV)), int(sys.argv[1]), int(sys.argv[2])
        )
    )
