"""The parallel layout of a group of ranks: every slice of the model a rank takes.

tp ranks form r latent groups x m head groups (DESIGN §1 "TPLA decode"); rank k sits at
(i, j) = (k // m, k % m). It holds latent columns S_i and the heads of group j, a 1/tp slice
of every dense MLP, of the shared experts and of the vocabulary. The routed experts go by the
MoE mode: a 1/tp column slice of every expert (`tp`), or whole experts, E/tp of them (`ep`).
In SP mode (r = 1) its cache holds round-robin chunks of each sequence's tokens at full width.

Pure integer arithmetic, no torch: the decode ranks, the leader's engine and `tpla plan` all
take their slices here. (common/kv/chunks.py keeps the per-position chunk arithmetic, which
also runs on tensors.)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from common.model.args import ModelConfig


class ParallelError(ValueError):
    """The requested parallel layout does not fit the model."""


class ParallelMode(enum.Enum):
    """How a decode group splits the latent cache over its ranks."""

    TPLA = "tpla"  # by latent columns (r groups); r = 1 is MLA-TP, the exact baseline
    SP = "sp"  # by token chunks, round-robin, full width; exact (log-sum-exp merge)


class MoeParallel(enum.Enum):
    """How a group splits a MoE layer's routed experts over its ranks (`TPLA_MOE_PARALLEL`)."""

    TP = "tp"  # every rank holds a 1/tp column slice of every expert
    EP = "ep"  # every rank holds whole experts, E/tp of them, and runs them for their tokens


class RmsNormMode(enum.Enum):
    """How a rank normalizes the latent of a newly generated token."""

    EXACT = "exact"  # compute the full small projection, normalize exactly, keep the slice
    SLICED = "sliced"  # see only x[S_i]: rms(x) ~ rms(x[S_i]) * sqrt(1 / (r e_i))


def split_range(total: int, parts: int, index: int, what: str) -> slice:
    """Part `index` of `total` cut into `parts` equal contiguous parts."""
    if total % parts:
        raise ParallelError(f"{what} ({total}) is not divisible by {parts}")
    size = total // parts
    return slice(index * size, (index + 1) * size)


def layout_label(name: str, latent_groups: int) -> str:
    """How errors and `tpla plan` name a layout: its name, with r for TPLA."""
    return f"tpla r={latent_groups}" if name == "tpla" else name


def span(s: slice) -> int:
    """How many rows (or columns, heads) a slice of this module covers."""
    return s.stop - s.start


@dataclass(frozen=True)
class ParallelConfig:
    """tp = latent_groups (r) x head_groups (m). r = 1 is MLA-TP; r = tp is full TPLA.

    In SP mode r = 1 and m = tp: projections are split by heads as in MLA-TP, and the cache
    by chunks of `chunk_size` tokens.
    """

    tp: int = 1
    latent_groups: int = 1
    rmsnorm: RmsNormMode = RmsNormMode.EXACT
    mode: ParallelMode = ParallelMode.TPLA
    chunk_size: int = 256
    moe: MoeParallel = MoeParallel.TP

    def __post_init__(self) -> None:
        if self.tp < 1 or self.latent_groups < 1 or self.tp % self.latent_groups:
            raise ParallelError(
                f"tp={self.tp} is not a multiple of latent_groups={self.latent_groups}"
            )
        if self.mode is ParallelMode.SP and self.latent_groups != 1:
            raise ParallelError("sequence parallelism keeps the full latent: latent_groups=1")
        if self.chunk_size < 1:
            raise ParallelError("chunk_size must be positive")

    @property
    def sp(self) -> bool:
        return self.mode is ParallelMode.SP

    @property
    def name(self) -> str:
        """tpla, mla-tp or sp: the layout's name in settings, load reports and plans."""
        if self.sp:
            return "sp"
        return "mla-tp" if self.latent_groups == 1 else "tpla"

    @property
    def label(self) -> str:
        return layout_label(self.name, self.latent_groups)

    @property
    def head_groups(self) -> int:
        return self.tp // self.latent_groups

    def coords(self, rank: int) -> tuple[int, int]:
        """(latent group i, head group j) of a rank."""
        return rank // self.head_groups, rank % self.head_groups

    # -- what a rank holds -----------------------------------------------------------------

    def heads(self, rank: int, num_heads: int) -> slice:
        """The attention heads of the rank's head group j."""
        _, j = self.coords(rank)
        return split_range(num_heads, self.head_groups, j, "num_attention_heads")

    def latent_columns(self, rank: int, d_c: int) -> slice:
        """The latent columns the rank caches: slice S_i of its latent group i."""
        i, _ = self.coords(rank)
        return split_range(d_c, self.latent_groups, i, "kv_lora_rank")

    def ffn_columns(self, rank: int, intermediate_size: int) -> slice:
        """The rank's slice of a dense MLP's intermediate dimension."""
        return split_range(intermediate_size, self.tp, rank, "intermediate_size")

    def expert_columns(self, rank: int, moe_intermediate_size: int) -> slice:
        """The rank's slice of each routed expert it holds (intermediate dimension): 1/tp of
        every expert under `tp`, whole experts under `ep`."""
        if self.moe is MoeParallel.EP:
            return slice(0, moe_intermediate_size)
        return split_range(moe_intermediate_size, self.tp, rank, "moe_intermediate_size")

    def owned_experts(self, rank: int, n_experts: int) -> slice:
        """The routed experts the rank holds: all of them under `tp`; under `ep` a contiguous
        run, split as evenly as it goes (the first n_experts % tp ranks hold one more)."""
        if self.moe is MoeParallel.TP:
            return slice(0, n_experts)
        size, extra = divmod(n_experts, self.tp)
        start = rank * size + min(rank, extra)
        return slice(start, start + size + (rank < extra))

    def shared_expert_columns(
        self, rank: int, moe_intermediate_size: int, n_shared_experts: int
    ) -> slice:
        """The rank's slice of the shared experts' intermediate dimension (fused as one)."""
        shared = moe_intermediate_size * n_shared_experts
        return split_range(shared, self.tp, rank, "shared experts' intermediate size")

    def vocab_rows(self, rank: int, vocab_size: int) -> slice:
        """The rank's lm_head rows: `torch.tensor_split`'s split, which checkpoints were
        sharded by (the first vocab_size % tp ranks get one extra row)."""
        size, extra = divmod(vocab_size, self.tp)
        start = rank * size + min(rank, extra)
        return slice(start, start + size + (rank < extra))

    def padded_vocab(self, vocab_size: int) -> int:
        """Every rank's logits are padded to this width for the gather (its widest slice)."""
        return -(-vocab_size // self.tp)

    def vocab_columns(self, vocab_size: int) -> list[int]:
        """The columns of a gathered [tp x padded_vocab] row that are the real vocabulary,
        in order: what the leader keeps."""
        padded = self.padded_vocab(vocab_size)
        return [
            rank * padded + k
            for rank in range(self.tp)
            for k in range(span(self.vocab_rows(rank, vocab_size)))
        ]

    def owned_ranges(self, rank: int, total: int) -> list[tuple[int, int]]:
        """The [start, end) position ranges of the first `total` tokens the rank caches: its
        round-robin chunks in SP mode, every token otherwise."""
        if not self.sp:
            return [(0, total)] if total else []
        c = self.chunk_size
        return [(s, min(s + c, total)) for s in range(rank * c, total, c * self.tp)]

    def check(self, c: ModelConfig) -> None:
        """Raise ParallelError, naming the layout, where a rank could not take its slices of
        model `c`."""
        moe = [c.is_moe_layer(n) for n in range(c.num_hidden_layers)]
        splits = [
            ("num_attention_heads", c.num_attention_heads, self.head_groups),
            ("kv_lora_rank", c.kv_lora_rank, self.latent_groups),
        ]
        if not all(moe):
            splits.append(("intermediate_size", c.intermediate_size, self.tp))
        if any(moe) and self.moe is MoeParallel.TP:
            splits.append(("moe_intermediate_size", c.moe_intermediate_size, self.tp))
        if any(moe) and self.moe is MoeParallel.EP and c.n_routed_experts < self.tp:
            raise ParallelError(
                f"{self.label}: expert parallelism gives each of {self.tp} ranks whole experts, "
                f"but the model has {c.n_routed_experts}"
            )
        if any(moe) and c.n_shared_experts:
            shared = c.moe_intermediate_size * c.n_shared_experts
            splits.append(("shared experts' intermediate size", shared, self.tp))
        for what, total, parts in splits:
            if total % parts:
                raise ParallelError(f"{self.label}: {what} ({total}) is not divisible by {parts}")
