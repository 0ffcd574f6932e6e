"""Single-process oracle for MLA, TPLA, TPLA with PD separation and GLA (DESIGN §1).

The distributed engine must reproduce these numbers. All per-shard math goes through
`common.model.tpla` (`shard_attention`, `head_output`, `new_token_latent`, `latent_shards`),
so the oracle and the engine share one implementation of it; this file only decides which
tokens are exact and which are sliced:

- `mla`: every token exact (the reparameterized model is exactly the original).
- `tpla`: every token sliced: its latent is normalized per `rmsnorm` and every query attends
  shard by shard (all heads on every slice S_i, softmax rescaled by beta_i), summed.
- `tpla-pd`: prompt tokens come from exact MLA prefill (exact latents, exact attention); each
  later token is sliced as in `tpla`, over the prompt's exact latents and its own.
- `gla`: head group i attends only to S_i, beta = 1 (the lossy baseline).

Two entry points compute the same thing: `forward` (teacher-forced, all queries of a layer
at once) and `prefill` + `decode` (token by token over a per-sequence latent cache). The
cache keeps full-width latents; for sliced tokens column block S_i holds shard i's own
normalization of that token, so shard i reads exactly what rank i would have cached.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from common.model.causal_lm import DeepseekForCausalLM
from common.model.generate import Generation
from common.model.mla import MLAttention
from common.model.rope import scale_queries
from common.model.tpla import (
    LatentShard,
    head_output,
    latent_shards,
    new_token_latent,
    shard_attention,
)
from common.parallel import ParallelConfig, RmsNormMode
from common.sampling.keyed import DrawKey
from common.sampling.params import SamplingParams
from common.sampling.sampler import first_tokens, request_seed, sample


class Variant(enum.Enum):
    """Attention variants, by their CLI / JSON name."""

    MLA = "mla"
    GLA = "gla"
    TPLA = "tpla"
    TPLA_PD = "tpla-pd"

    @property
    def sliced_latents(self) -> bool:
        """Whether new tokens' latents are normalized per shard (TPLA's RMSNorm option)."""
        return self in (Variant.TPLA, Variant.TPLA_PD)


@dataclass(frozen=True)
class AttentionSpec:
    """Which attention the oracle runs: variant, latent groups r, RMSNorm mode for TPLA."""

    variant: Variant = Variant.MLA
    groups: int = 1
    rmsnorm: RmsNormMode = RmsNormMode.EXACT

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ValueError(f"latent groups must be >= 1, got {self.groups}")


@dataclass
class SequenceState:
    """One sequence's latent cache: per layer n [T, d_c] and k_pe [T, d_r]."""

    n: list[Tensor] = field(default_factory=list)
    k_pe: list[Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return int(self.n[0].shape[0]) if self.n else 0


class ReferenceModel:
    """Oracle over a (reparameterized) model: teacher-forced forward and token-by-token decode.

    `spectra` holds E[n_k^2] per latent dimension for each layer, in the basis the model's
    latent is in (from the side file); None for a layer means e_i = 1/r.
    """

    def __init__(
        self,
        model: DeepseekForCausalLM,
        spec: AttentionSpec,
        spectra: Sequence[Tensor | None] | None = None,
    ) -> None:
        c = model.config
        if c.kv_lora_rank % spec.groups:
            raise ValueError(
                f"latent width {c.kv_lora_rank} is not divisible into {spec.groups} groups"
            )
        if spec.variant is Variant.GLA and c.num_attention_heads % spec.groups:
            raise ValueError(
                f"GLA needs the {c.num_attention_heads} heads divisible into {spec.groups} groups"
            )
        spectra = list(spectra) if spectra is not None else [None] * c.num_hidden_layers
        if len(spectra) != c.num_hidden_layers:
            raise ValueError(f"{len(spectra)} spectra for {c.num_hidden_layers} layers")
        self.model = model
        self.spec = spec
        # GLA uses no beta, so its shards need no energies.
        slices = ParallelConfig(spec.groups, spec.groups).latent_slices(c.kv_lora_rank)
        self.shards: list[list[LatentShard]] = [
            latent_shards(slices, None if spec.variant is Variant.GLA else s) for s in spectra
        ]

    # -- entry point (a): teacher forcing ---------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, prefill_len: int = 0) -> Tensor:
        """Logits [T, V] for one sequence; `prefill_len` prompt tokens are exact for tpla-pd."""
        if input_ids.ndim != 1 or input_ids.numel() == 0:
            raise ValueError("input_ids must be a non-empty 1-D tensor")
        if prefill_len < 0:
            raise ValueError(f"prefill_len must be >= 0, got {prefill_len}")
        return self._run(SequenceState(), input_ids, self._exact_rows(len(input_ids), prefill_len))

    # -- entry point (b): token by token ----------------------------------------------------

    def start(self) -> SequenceState:
        return SequenceState()

    @torch.inference_mode()
    def prefill(self, state: SequenceState, prompt_ids: Tensor) -> Tensor:
        """Process the prompt into an empty `state`; logits [P, V] (tpla-pd: exact MLA)."""
        if state.length:
            raise ValueError("prefill needs an empty sequence state")
        if prompt_ids.ndim != 1 or prompt_ids.numel() == 0:
            raise ValueError("prompt_ids must be a non-empty 1-D tensor")
        return self._run(state, prompt_ids, self._exact_rows(len(prompt_ids), len(prompt_ids)))

    @torch.inference_mode()
    def decode(self, state: SequenceState, token_id: int) -> Tensor:
        """Append one generated token (sliced for TPLA variants); logits [V] for the next."""
        if not state.length:
            raise ValueError("decode needs a prefilled sequence state")
        ids = torch.tensor([token_id], dtype=torch.long, device=self.model.lm_head.weight.device)
        return self._run(state, ids, self._exact_rows(1, 0))[0]

    # -- the math ---------------------------------------------------------------------------

    def _exact_rows(self, count: int, prefill_len: int) -> int:
        if self.spec.variant is Variant.MLA:
            return count
        if self.spec.variant is Variant.TPLA_PD:
            return min(prefill_len, count)
        return 0

    def _run(self, state: SequenceState, ids: Tensor, exact: int) -> Tensor:
        m = self.model
        start = state.length
        if start + len(ids) > m.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {start + len(ids)} exceeds the model's context of "
                f"{m.config.max_position_embeddings}"
            )
        positions = torch.arange(start, start + len(ids), device=ids.device)
        cos, sin = m.rope.cos_sin(positions)
        q_scale = m.rope.query_scale(positions)
        h = m.model.embed_tokens(ids)
        for i, layer in enumerate(m.model.layers):
            x = layer.input_layernorm(h)
            h = layer.feed_forward(
                h + self._attention(i, layer.self_attn, x, (cos, sin, q_scale), state, exact)
            )
        return m.logits(h)

    def _attention(
        self,
        index: int,
        attn: MLAttention,
        x: Tensor,
        angles: tuple[Tensor, Tensor, Tensor | None],
        state: SequenceState,
        exact: int,
    ) -> Tensor:
        """Layer output [Q, D] for Q new tokens; the first `exact` of them are exact MLA.
        `angles`: the rows' cos, sin and query factor (None: unscaled)."""
        rope = self.model.rope
        cos, sin, q_scale = angles
        q_nope, q_pe = scale_queries(*attn.queries(x, rope, cos, sin), q_scale)
        n, k_pe = attn.latents(x, rope, cos, sin)
        shards = self.shards[index]
        count = x.shape[0]
        if self.spec.variant.sliced_latents and exact < count:
            sliced = [
                new_token_latent(attn, x[exact:], s, self.spec.rmsnorm, k_pe[exact:])[0]
                for s in shards
            ]
            n = torch.cat((n[:exact], torch.cat(sliced, -1)))
        if index < len(state.n):
            state.n[index] = torch.cat((state.n[index], n))
            state.k_pe[index] = torch.cat((state.k_pe[index], k_pe))
        else:
            state.n.append(n)
            state.k_pe.append(k_pe)
        n_all, k_pe_all = state.n[index], state.k_pe[index]
        total = n_all.shape[0]
        first = total - count
        keys = torch.arange(total, device=x.device)
        valid = keys[None] <= torch.arange(first, total, device=x.device)[:, None]  # [Q, T]
        parts = []
        if exact:
            parts.append(
                self._exact(
                    attn, q_nope[:exact], q_pe[:exact], n_all, k_pe_all, valid[:exact], first
                )
            )
        if exact < count:
            parts.append(
                self._sliced(
                    attn, shards, q_nope[exact:], q_pe[exact:], n_all, k_pe_all, valid[exact:]
                )
            )
        return torch.cat(parts)

    def _exact(
        self,
        attn: MLAttention,
        q_nope: Tensor,
        q_pe: Tensor,
        n: Tensor,
        k_pe: Tensor,
        valid: Tensor,
        first: int,
    ) -> Tensor:
        rows = q_nope.shape[0]
        if first == 0:
            # A prompt with no history: the model's own expanded prefill path (fastest, exact).
            o = attn.expanded(
                q_nope, q_pe, n[:rows], k_pe[:rows], [0, rows], self.model.prefill_attention
            )
        else:
            o = attn.absorbed(q_nope[None], q_pe[None], n[None], k_pe[None], valid[None])[0]
        return attn.output(o)

    def _sliced(
        self,
        attn: MLAttention,
        shards: list[LatentShard],
        q_nope: Tensor,
        q_pe: Tensor,
        n: Tensor,
        k_pe: Tensor,
        valid: Tensor,
    ) -> Tensor:
        out = torch.zeros(
            q_nope.shape[0], attn.o_proj.weight.shape[0], dtype=q_nope.dtype, device=q_nope.device
        )
        per_group = attn.num_heads // len(shards)
        for s in shards:
            if self.spec.variant is Variant.GLA:
                heads, beta = slice(s.index * per_group, (s.index + 1) * per_group), 1.0
            else:
                heads, beta = slice(None), None  # all heads on every slice; beta_i from e_i
            o = shard_attention(
                attn,
                q_nope[None, :, heads],
                q_pe[None, :, heads],
                n[None, :, s.start : s.end],
                k_pe[None],
                valid[None],
                s,
                heads,
                beta=beta,
            )
            out += head_output(attn, o[0], heads)
        return out


def generate(
    oracle: ReferenceModel,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    eos_ids: Sequence[int] = (),
) -> Generation:
    """Generate with the oracle: prefill the prompt, then one `decode` per new token.

    Sampling uses the served stack's keyed draws (`first_tokens`, then one key per position),
    so a seeded request reproduces the engine's tokens.
    """
    if not prompt_ids:
        raise ValueError("prompt must contain at least one token")
    config = oracle.model.config
    if min(prompt_ids) < 0 or max(prompt_ids) >= config.vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {config.vocab_size})")
    if len(prompt_ids) + params.max_tokens > config.max_position_embeddings:
        raise ValueError(
            f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds the "
            f"model's context of {config.max_position_embeddings} tokens"
        )
    device = oracle.model.lm_head.weight.device
    eos = frozenset(eos_ids)
    state = oracle.start()
    logits = oracle.prefill(state, torch.tensor(list(prompt_ids), dtype=torch.long, device=device))[
        -1
    ]
    # The served stack's keys (the prefill worker's first token, the decode leader's
    # positions after it), so seeded requests match.
    seed = request_seed(params)
    params = replace(params, seed=seed)
    tokens = list(first_tokens(logits, params, position=len(prompt_ids)))
    while (reason := params.finish_reason(tokens[-1].token_id, len(tokens), eos)) is None:
        logits = oracle.decode(state, tokens[-1].token_id)
        key = DrawKey(seed, 0, len(prompt_ids) + len(tokens))
        tokens.append(sample(logits, params, key))
    return Generation([t.token_id for t in tokens], tokens, reason)
