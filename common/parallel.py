"""The parallel layout of a group of ranks: every slice of the model a rank takes.

tp ranks form r latent groups x m head groups (DESIGN §1 "TPLA decode"); rank k sits at
(i, j) = (k // m, k % m). It holds latent columns S_i and the heads of group j, a 1/tp slice
of every dense MLP, of the shared experts and of the vocabulary. The routed experts go by the
MoE mode: a 1/tp column slice of every expert (`tp`), or whole experts, E/tp of them (`ep`).
In SP mode (r = 1) its cache holds round-robin chunks of each sequence's tokens at full width:
position p is in chunk p // C, owned by rank (p // C) mod tp, and each rank stores its tokens
contiguously in chunk order, so its local cache is an ordinary growing sequence.

The layouts' names (`LAYOUT_NAMES`), their parser and what each layout means for a rank live
here and nowhere else (tests/unit/test_layout_locality.py). Pure integer arithmetic, no
torch: the decode ranks, the leader's engine and `tpla plan` all take their slices here; the
token arithmetic also runs elementwise on integer tensors.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol


class ParallelError(ValueError):
    """The requested parallel layout does not fit the model."""


class ParallelMode(enum.Enum):
    """A decode group's layout: how it splits the latent cache over its ranks. The values are
    the layouts' names in settings, flags, plans and load reports."""

    TPLA = "tpla"  # by latent columns, r > 1 groups
    MLA_TP = "mla-tp"  # TPLA with r = 1: heads split, the latent replicated; the exact baseline
    SP = "sp"  # by token chunks, round-robin, full width; exact (log-sum-exp merge)

    def latent_groups(self, requested: int) -> int:
        """r as this layout takes it: the requested r in TPLA, 1 otherwise."""
        return requested if self is ParallelMode.TPLA else 1


class MoeParallel(enum.Enum):
    """How a group splits a MoE layer's routed experts over its ranks (`TPLA_MOE_PARALLEL`)."""

    TP = "tp"  # every rank holds a 1/tp column slice of every expert
    EP = "ep"  # every rank holds whole experts, E/tp of them, and runs them for their tokens


class RmsNormMode(enum.Enum):
    """How a rank normalizes the latent of a newly generated token."""

    EXACT = "exact"  # compute the full small projection, normalize exactly, keep the slice
    SLICED = "sliced"  # see only x[S_i]: rms(x) ~ rms(x[S_i]) * sqrt(1 / (r e_i))


# What flags and settings accept, in the order they list them.
LAYOUT_NAMES = tuple(m.value for m in ParallelMode)
MOE_MODES = tuple(m.value for m in MoeParallel)
RMSNORM_MODES = tuple(m.value for m in RmsNormMode)
# The order plans and benchmarks set layouts side by side in: the exact baseline first.
BASELINE = ParallelMode.MLA_TP
COMPARED = (BASELINE, ParallelMode.TPLA, ParallelMode.SP)


def _one_of(names: tuple[str, ...]) -> str:
    return f"{', '.join(names[:-1])} or {names[-1]}"


def parse_mode(name: str) -> ParallelMode:
    """A layout by its name (`TPLA_PARALLEL`, `--parallel`); ValueError naming the choices."""
    if name not in LAYOUT_NAMES:
        raise ParallelError(f"parallel mode {name!r} is not {_one_of(LAYOUT_NAMES)}")
    return ParallelMode(name)


def parse_moe(name: str) -> MoeParallel:
    """A MoE mode by its name (`TPLA_MOE_PARALLEL`, `--moe-parallel`)."""
    if name not in MOE_MODES:
        raise ParallelError(f"MoE parallel mode {name!r} is not {_one_of(MOE_MODES)}")
    return MoeParallel(name)


def split_range(total: int, parts: int, index: int, what: str) -> slice:
    """Part `index` of `total` cut into `parts` equal contiguous parts."""
    if total % parts:
        raise ParallelError(f"{what} ({total}) is not divisible by {parts}")
    size = total // parts
    return slice(index * size, (index + 1) * size)


def layout_label(name: str, latent_groups: int) -> str:
    """How errors and `tpla plan` name a layout: its name, with r for TPLA."""
    return f"tpla r={latent_groups}" if name == ParallelMode.TPLA.value else name


def span(s: slice) -> int:
    """How many rows (or columns, heads) a slice of this module covers."""
    return s.stop - s.start


class ModelShape(Protocol):
    """What a layout splits of a model (common.model.args.ModelConfig has it): the layout
    module stays below the model's."""

    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int

    def is_moe_layer(self, layer: int) -> bool: ...


@dataclass(frozen=True)
class ParallelConfig:
    """tp = latent_groups (r) x head_groups (m). r = 1 is MLA-TP; r = tp is full TPLA.

    In SP mode r = 1 and m = tp: projections are split by heads as in MLA-TP, and the cache
    by chunks of `chunk_size` tokens. TPLA asked with r = 1 is MLA-TP, and is stored as such:
    one layout, one value, one name.
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
        if self.mode is ParallelMode.MLA_TP and self.latent_groups != 1:
            raise ParallelError("mla-tp keeps the full latent on every rank: latent_groups=1")
        if self.chunk_size < 1:
            raise ParallelError("chunk_size must be positive")
        if self.mode is ParallelMode.TPLA and self.latent_groups == 1:
            object.__setattr__(self, "mode", ParallelMode.MLA_TP)

    @classmethod
    def parse(
        cls,
        mode: str,
        tp: int,
        latent_groups: int = 1,
        rmsnorm: str = RmsNormMode.EXACT.value,
        chunk_size: int = 256,
        moe: str = MoeParallel.TP.value,
    ) -> ParallelConfig:
        """The layout named by settings or flags (r is taken by TPLA only: `mla-tp` and `sp`
        keep the full latent whatever `latent_groups` says); ParallelError naming what is
        wrong."""
        layout = parse_mode(mode)
        return cls(
            tp,
            layout.latent_groups(latent_groups),
            RmsNormMode(rmsnorm),
            layout,
            chunk_size,
            parse_moe(moe),
        )

    @classmethod
    def compared(
        cls,
        tp: int,
        latent_groups: tuple[int, ...],
        rmsnorm: RmsNormMode = RmsNormMode.EXACT,
        chunk_size: int = 256,
        moe: MoeParallel = MoeParallel.TP,
    ) -> list[tuple[ParallelMode, ParallelConfig]]:
        """(asked layout, layout) for each layout a plan sets side by side, in `COMPARED`'s
        order, TPLA once for each of `latent_groups` (r = 1 too, which is MLA-TP)."""
        return [
            (mode, cls(tp, r, rmsnorm, mode, chunk_size, moe))
            for mode in COMPARED
            for r in (latent_groups if mode is ParallelMode.TPLA else (1,))
        ]

    def to_dict(self) -> dict[str, int | str]:
        """The layout as JSON values: what `parse(**d)` reads back."""
        return {
            "tp": self.tp,
            "latent_groups": self.latent_groups,
            "rmsnorm": self.rmsnorm.value,
            "mode": self.mode.value,
            "chunk_size": self.chunk_size,
            "moe": self.moe.value,
        }

    @property
    def name(self) -> str:
        """tpla, mla-tp or sp: the layout's name in settings, load reports and plans."""
        return self.mode.value

    @property
    def label(self) -> str:
        return layout_label(self.name, self.latent_groups)

    @property
    def head_groups(self) -> int:
        return self.tp // self.latent_groups

    @property
    def splits_heads_only(self) -> bool:
        """MLA-TP: the ranks split the heads (and every FFN), each caches every token's whole
        latent; a prefill group's ranks are laid out so."""
        return self.mode is ParallelMode.MLA_TP

    def coords(self, rank: int) -> tuple[int, int]:
        """(latent group i, head group j) of a rank."""
        return rank // self.head_groups, rank % self.head_groups

    # -- what a rank holds -----------------------------------------------------------------

    def heads(self, rank: int, num_heads: int) -> slice:
        """The attention heads of the rank's head group j."""
        _, j = self.coords(rank)
        return split_range(num_heads, self.head_groups, j, "num_attention_heads")

    def prefill_heads(self, rank: int, num_heads: int) -> slice:
        """The heads whose whole-latent attention the rank computes when its group prefills a
        prompt itself: part i of its head group j's heads cut into r parts, so the tp ranks'
        parts are disjoint and cover every head (its heads where r = 1). Every rank then
        holds the prompt's whole latent, as a prefill rank does (MLA-TP), and the layer's
        all-reduce sums the parts."""
        i, _ = self.coords(rank)
        group = self.heads(rank, num_heads)
        size = span(group)
        if size % self.latent_groups:
            raise ParallelError(
                f"{self.label}: a head group's {size} heads do not split over "
                f"{self.latent_groups} latent groups for a local prefill"
            )
        part = size // self.latent_groups
        return slice(group.start + i * part, group.start + (i + 1) * part)

    def latent_columns(self, rank: int, d_c: int) -> slice:
        """The latent columns the rank caches: slice S_i of its latent group i (the leader
        cuts a prompt's KV by them, the rank's attention reads them)."""
        i, _ = self.coords(rank)
        return split_range(d_c, self.latent_groups, i, "kv_lora_rank")

    def latent_slices(self, d_c: int) -> list[slice]:
        """S_1 .. S_r: the latent columns of every latent group, in order."""
        return [self.latent_columns(i * self.head_groups, d_c) for i in range(self.latent_groups)]

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

    # -- which tokens a rank caches, and where ----------------------------------------------
    # Positions are ints or integer tensors (elementwise): the leader's pools count with ints,
    # a rank's step addresses its cache with tensors.

    @property
    def caches_every_token(self) -> bool:
        """Every rank caches every token of a sequence (its latent columns): TPLA, MLA-TP.
        In SP a rank caches only the tokens of its own chunks."""
        return self.mode is not ParallelMode.SP

    @property
    def token_ranks(self) -> int:
        """How many ranks a sequence's tokens are dealt over, each with its own block table:
        tp in SP, 1 where every rank caches every token (one table serves them all)."""
        return 1 if self.caches_every_token else self.tp

    def token_owner(self, position: Any) -> Any:
        """The pool `position` is cached in (of `token_ranks`): in SP the rank owning its
        chunk; otherwise 0, the one pool every rank shares."""
        if self.caches_every_token:
            return 0
        return (position // self.chunk_size) % self.tp

    def local_position(self, position: Any) -> Any:
        """Where the rank caching `position` stores it in its own, contiguous token order."""
        if self.caches_every_token:
            return position
        c = self.chunk_size
        return (position // c // self.tp) * c + position % c

    def global_position(self, local: Any, rank: int) -> Any:
        """The sequence position of token `local` of rank `rank`'s own order (the inverse
        of `local_position` on the tokens the rank caches)."""
        if self.caches_every_token:
            return local
        c = self.chunk_size
        return (local // c * self.tp + rank) * c + local % c

    def most_tokens(self, local_tokens: int) -> int:
        """The longest sequence whose tokens on every rank fit in `local_tokens` (a step's
        table width): that many where every rank caches every token; in SP tp times as
        many (rank 0, which caches the most of a sequence, holds at least 1/tp of it)."""
        return local_tokens * self.token_ranks

    def local_length(self, total: Any, rank: int) -> Any:
        """How many of a sequence's first `total` tokens rank `rank` caches."""
        if self.caches_every_token:
            return total
        c, ranks = self.chunk_size, self.tp
        full_rounds, rest = total // (c * ranks), total % (c * ranks)
        mine = rest - rank * c
        mine = min(max(mine, 0), c) if isinstance(mine, int) else mine.clamp(0, c)
        return full_rounds * c + mine

    def owned_ranges(self, rank: int, total: int) -> list[tuple[int, int]]:
        """The [start, end) position ranges of the first `total` tokens the rank caches: its
        round-robin chunks in SP mode, every token otherwise."""
        if self.caches_every_token:
            return [(0, total)] if total else []
        c = self.chunk_size
        return [(s, min(s + c, total)) for s in range(rank * c, total, c * self.tp)]

    def token_ranges(self, rank: int, start: int, end: int) -> tuple[int, ...]:
        """The positions in [start, end) the rank caches as a KV target names them
        (`KvTargetInfo.token_ranges`: lo, hi, lo, hi, ...): () for every token, (0, 0) for
        none."""
        if self.caches_every_token:
            return ()
        owned = self.owned_ranges(rank, end)
        kept = [x for lo, hi in owned if hi > start for x in (max(lo, start), hi)]
        return tuple(kept) or (0, 0)

    def keeps_whole_blocks(self, block_size: int) -> bool:
        """Whether every block of a sequence is a whole block of one rank's pool (what prefix
        reuse needs): always where every rank caches every token; in SP when a chunk is
        whole blocks."""
        return self.caches_every_token or self.chunk_size % block_size == 0

    def check(self, c: ModelShape) -> None:
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
                hint = ""
                if what == "num_attention_heads":
                    groups = [d for d in range(1, total + 1) if total % d == 0]
                    hint = (
                        f"; head groups that split {total} heads: {groups} "
                        f"(tp = latent groups x head groups)"
                    )
                raise ParallelError(
                    f"{self.label}: {what} ({total}) is not divisible by {parts}{hint}"
                )
