"""What every decode rank runs: its model share and KV pool on its device, and its step.

The leader (rank 0) and follower ranks share `RankRuntime`; only the leader schedules. A
follower's process runs it under services/decode/group/follower.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist
from torch import Tensor, nn

from common.group.setup import open_comm
from common.group.spec import GroupSpec
from common.kv.epochs import BlockEpochs, StaleEpoch
from common.kv.index_cache import blocks_for_budget
from common.kv.paged_cache import CacheReads, PagedLatentCache
from common.kv.receiver import KvReceiverServicer, ShardTarget, add_kv_receiver
from common.kv.wire import TransferError, shard_slots
from common.loading.serving_kernels import PrefillKernels, WeightKernels
from common.loading.serving_model import open_serving_weights
from common.loading.weights import ModelWeights
from common.rpc.clients import CHANNEL_OPTIONS
from common.rpc.gen import kv_pb2
from common.runtime.device import rank_device, use_device
from common.runtime.host_syncs import HostSyncCounter
from common.runtime.ports import bind_grpc, check_ports, kv_receiver_ports
from common.runtime.transfers import to_device_tensor
from services.decode.config import EngineConfig
from services.decode.rank.backends import decode_backend, select_decode_kernel
from services.decode.rank.block_tables import RankTables
from services.decode.rank.draft_pass import draft_pass
from services.decode.rank.graphs import StepGraphs, uncapturable
from services.decode.rank.prefill_pass import PrefillPass
from services.decode.rank.prefill_stack import RankPrefillStack
from services.decode.rank.rank_model import RankModel
from services.decode.rank.step_inputs import StepInputs
from services.decode.step_plan import (
    CopyPlan,
    DecodePlan,
    EpochPlan,
    PrefillPlan,
    WritePlan,
    token_rows,
)

log = logging.getLogger(__name__)


class RankRuntime:
    """One rank's model share and KV pool on its device; `step` runs a decode plan."""

    def __init__(self, cfg: EngineConfig, rank: int, group: GroupSpec) -> None:
        """`group`: the group this rank is one of (services/decode/group/spec.py forms it)."""
        self.cfg, self.rank = cfg, rank
        self.device = rank_device(cfg.device, cfg.local_index(rank))
        torch.set_num_threads(cfg.torch_threads)
        dtype = getattr(torch, cfg.dtype)
        # Chosen before the weights load: a kernel named that cannot run here stops it now.
        attention = select_decode_kernel(cfg.kernels.decode_attention, self.device, dtype)
        weight_kernels = WeightKernels.select(cfg.kernels, self.device, dtype)
        self.kernels = (attention, *weight_kernels.choices)
        # A group that prefills prompts itself runs the prefill worker's attention kernel.
        prefill = None
        if cfg.local_prefill:
            prefill = PrefillKernels.select(cfg.kernels, self.device, dtype)
        # Only this rank's share is read from the checkpoint, straight onto its device.
        # The MTP module and its cache layer only where its drafts are asked for.
        mtp = cfg.speculative.method == "mtp"
        weights, spectra = open_serving_weights(
            cfg.model, cfg.reparam, cfg.dtype, self.device, cfg.weight_dtype, mtp=mtp
        )
        spectra = spectra[: weights.config.num_hidden_layers + mtp]
        self.model = RankModel(weights, cfg.parallel, rank, spectra)
        self.model.place(self.device)
        weight_kernels.apply(self.model)
        self.model.use_backend(decode_backend(attention.kernel))
        self.layout = self.model.cache_layout(cfg.block_size, dtype)
        keys = self.model.index_layout(cfg.block_size, cfg.index_cache_dtype, dtype)
        layouts = [self.layout] if keys is None else [self.layout, keys]
        num_blocks = blocks_for_budget(int(cfg.kv_budget_mb * 2**20), layouts)
        self.cache = PagedLatentCache(self.layout, num_blocks, self.device)
        # Which reservation may still push into each block (a late push's rows never land).
        self.epochs = BlockEpochs(num_blocks)
        # DSA: the indexer keys' pool, in the same blocks (common/kv/index_cache.py).
        self.index_cache = None if keys is None else PagedLatentCache(keys, num_blocks, self.device)
        if self.index_cache is not None:
            self.model.bind_index_pool(self.index_cache)
        self.comm = open_comm(group, rank, self.device)
        self.prefills = self._prefill_pass(weights, prefill, weight_kernels)
        if self.prefills is not None and prefill is not None:
            self.kernels = (*self.kernels, prefill.attention)
        self.inputs = StepInputs(self.device)
        # Every running sequence's block table, kept here; each plan brings its edits.
        positions = cfg.context_limit(weights.config.max_position_embeddings)
        pool = rank if cfg.parallel.token_ranks > 1 else 0
        max_blocks = -(-positions // cfg.block_size)
        self.tables = RankTables(cfg.max_batch, max_blocks, pool, self.device)
        # With the MTP module, the draft pass's inputs (rank/draft_pass.py), on the device:
        # the last step's hidden states before the final norm (rows [0, R)) and the plan's
        # prefill seeds (rows [R, 2R)), R = max_batch. One buffer that never moves: a
        # captured step reads and writes it in place.
        self.known: Tensor | None = None
        if self.model.mtp is not None:
            d = self.model.config.hidden_size
            self.known = torch.zeros(2 * cfg.max_batch, d, dtype=dtype, device=self.device)
        # Each bucket's step captured once and replayed (CUDA only: a CPU step has no
        # launches to save), where every kernel of the step can be.
        self.graphs: StepGraphs | None = None
        # Called with a shard's request id once its rows are in this rank's cache: the
        # leader renews the reservation's lease by it (a follower has no scheduler).
        self.landed: Callable[[str], None] | None = None
        # Steps run eager where the group replays graphs (a kernel that cannot be captured):
        # `tpla:decode_eager_steps_total`, which a GPU deployment keeps at 0.
        self.eager_steps = 0
        self._replays = cfg.cuda_graphs and self.device.type == "cuda"
        if self._replays:
            blocked = uncapturable(self.model)
            if blocked is None:
                state = () if self.known is None else (self.known,)
                self.graphs = StepGraphs(self.device, self.decode, state)
            else:
                log.warning("rank %d: decode steps run without CUDA graphs: %s", rank, blocked)

    def _prefill_pass(
        self, weights: ModelWeights, prefill: PrefillKernels | None, kernels: WeightKernels
    ) -> PrefillPass | None:
        """The rank's part of the prompts its group prefills itself, where asked (`prefill`:
        the chosen kernels) and the model is one the pass runs."""
        if prefill is not None and weights.config.dsa is not None:
            # The pass writes latents only, not the indexer keys a sparse layer selects by:
            # the router sends this model's prompts to prefill workers.
            if self.rank == 0:  # a warning: TPLA_DISAGG_POLICY auto / never get a worker
                log.warning(
                    "local prefill off: the prefill pass does not write DSA indexer keys, "
                    "so prompts go to prefill workers whatever TPLA_DISAGG_POLICY says"
                )
            return None
        if prefill is None:
            return None
        stack = RankPrefillStack(
            weights, self.model, self.cfg.parallel, self.comm, prefill.attention_backend()
        )
        kernels.apply(nn.ModuleList(stack.layers))
        return PrefillPass(stack, self.model.split, self.cache, self.comm, self.cfg.parallel)

    def step(self, plan: DecodePlan) -> Tensor:
        """Run one decode step; returns this rank's padded logits slice [B, V/tp]. A plan
        that asks for it (`count_syncs`) gets one more row: this rank's host waits in the
        step, in column 0."""
        self.tables.apply(plan.edits)
        if plan.mtp is not None and len(plan.mtp.seeds) and self.known is not None:
            seeds = to_device_tensor(plan.mtp.seeds, self.device)
            self.known[self.cfg.max_batch :][: len(seeds)].copy_(seeds)
        if not plan.count_syncs:
            inputs = self.inputs.load(plan)
            if self.graphs is not None:
                return self.graphs.run(inputs)
            self.eager_steps += self._replays
            return self.decode(inputs)
        with HostSyncCounter() as counter:
            logits = self.decode(self.inputs.load(plan))
        row = torch.zeros(1, logits.shape[1], dtype=logits.dtype, device=logits.device)
        row[0, 0] = counter.count
        return torch.cat((logits, row))

    def decode(self, plan: DecodePlan) -> Tensor:
        """The step on the plan's tensors on this rank's device: static shapes for the
        plan's bucket (`DecodePlan.bucket`), nothing read back to the host.

        Reads span the tables' whole (bucketed) width; every row writes its new token, the
        ones this rank must not store (padding rows, SP tokens another rank owns) into the
        cache's trash slot."""
        positions, width = plan.positions, plan.width
        tables = self.tables.rows(plan.slots, width)
        tokens, cache, comm = plan.tokens, self.cache, self.comm
        if plan.mtp is not None:
            assert self.known is not None  # a group started with the MTP module
            padding = plan.slots.new_full((1,), self.tables.padding)
            tokens = draft_pass(
                self.model,
                plan.mtp,
                tokens,
                torch.cat((plan.slots, padding)),
                lambda rows: self.tables.rows(rows, width),
                self.known,
                self.address,
                cache,
                comm,
            )
        write_slots, reads = self.address(positions, tables)
        if self.known is None:
            return self.model.decode_step(tokens, positions, write_slots, reads, cache, comm)
        hidden = self.model.decode_hidden(tokens, positions, write_slots, reads, cache, comm)
        self.known[: hidden.shape[0]].copy_(hidden)
        logits = self.model.logits(hidden)
        if plan.mtp is None:
            return logits
        # The leader learns the drafts with the logits: the tokens the rows were fed.
        return torch.cat((logits, token_rows(tokens, logits.shape[1], logits.dtype)))

    def prefill(self, plan: PrefillPlan) -> Tensor | None:
        """This rank's part of a prompt piece the group prefills itself (rank/prefill_pass.py):
        the logits the plan asks for, else None."""
        if self.prefills is None:
            raise RuntimeError("this decode group was started without local prefill")
        return self.prefills.run(plan)

    def prefilled_hidden(self) -> Tensor | None:
        """The last prefill piece's last hidden state of each prompt [S, D], where the rank
        holds the MTP module (its drafts start from it); else None."""
        return None if self.prefills is None else self.prefills.last_hidden

    def address(self, positions: Tensor, tables: Tensor) -> tuple[Tensor, CacheReads]:
        """Rows at `positions` with block tables [B, W] -> where each row's latent goes on
        this rank (the trash slot where it must not be stored) and what the rows read: as its
        layout says (`CacheSplit.address`)."""
        split = self.model.split
        return split.address(positions, tables, self.cfg.block_size, self.cache.trash_slot)

    def shard_target(self, header: kv_pb2.KvHeader) -> ShardTarget:
        """KV receiver sink: validate a transferred shard's header; the receiver then writes
        the shard into its blocks as it arrives, each segment only while the shard's epoch is
        its blocks' (`epochs`): a push of a reservation whose blocks were given out again is
        refused here or cut short there (StaleEpoch), and counted.

        Safe beside the step loop: the blocks belong to a reservation that is not running.
        The shard's landing is reported to `landed`, when set.
        """
        cache = self.cache if not header.index_keys else self.index_cache
        if cache is None:
            raise TransferError("an index-key shard sent to a rank of a model without DSA")
        lay = cache.layout
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
        if len(slots) and int(slots.max()) >= cache.trash_slot:
            raise TransferError("shard addresses blocks outside this rank's pool")
        blocks = torch.tensor(list(header.block_ids), dtype=torch.int64)
        if not self.epochs.live(blocks, header.epoch):
            self.epochs.count_drop()
            raise StaleEpoch(
                f"request {header.request_id}: epoch {header.epoch} is no longer its blocks' "
                "(the reservation ended and its blocks were given out again)"
            )
        landed, request_id = self.landed, header.request_id
        written = None if landed is None else lambda _seconds: landed(request_id)
        return ShardTarget(cache, slots, written, self.epochs)

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
        pool = ThreadPoolExecutor(16, initializer=use_device, initargs=(self.device,))
        server = grpc.server(pool, options=CHANNEL_OPTIONS)
        self.receiver = KvReceiverServicer(
            self.shard_target, store, self.cfg.internal_token, device=self.device
        )
        add_kv_receiver(self.receiver, server)
        bind_grpc(server, host, grpc_use)
        server.start()
        self._store = store  # keep the TCPStore server alive with the receiver
        return server

    def give_blocks(self, plan: EpochPlan) -> None:
        """A new reservation's blocks on this rank are its epoch's from now on."""
        self.epochs.give(plan.rank_blocks(self.rank), plan.epoch)

    def copy_blocks(self, plan: CopyPlan) -> None:
        """This rank's part of a block copy (forks of a prompt: see Scheduler)."""
        pairs = plan.rank_pairs(self.rank).to(self.device)
        if len(pairs):
            for cache in (self.cache, self.index_cache):
                if cache is not None:
                    cache.copy_blocks(pairs[:, 0], pairs[:, 1])

    def receive_write(self, plan: WritePlan) -> None:
        """Follower side of a local KV write: receive the shard from the leader."""
        if plan.target != self.rank:
            return
        lay, n = self.layout, len(plan.slots)
        lat = torch.empty(lay.num_layers, n, lay.latent_width, dtype=lay.dtype, device=self.device)
        rope = torch.empty(lay.num_layers, n, lay.rope_width, dtype=lay.dtype, device=self.device)
        self.comm.recv(lat, 0)
        self.comm.recv(rope, 0)
        slots = plan.slots.to(self.device)
        self.cache.write_all_layers(slots, lat, rope)
        if (keys := self.index_cache) is not None:  # DSA: the indexer keys follow
            lay = keys.layout
            shape = (lay.num_layers, n, lay.latent_width)
            rows = torch.empty(shape, dtype=lay.dtype, device=self.device)
            self.comm.recv(rows, 0)
            keys.write_all_layers(slots, rows, rows[..., :0])
