"""Where a model's weights come from: a loaded model, or a checkpoint read slice by slice.

Both sources answer the same questions by our parameter names (`model.layers.N.self_attn.
kv_b_proj.weight`, fused `mlp.experts.gate_up_proj`): "rows a:b, columns c:d of this tensor"
and "these columns of these experts". The full model (`build_model`) and a decode rank
(`RankModel`) are both built from a source, so a rank reading a checkpoint gets exactly the
tensors it would have sliced out of the loaded model, without the model ever existing.

A checkpoint source may keep an FP8 checkpoint's linear weights in FP8 (`keep_fp8`): `linear`,
`gate_up` and `down` then give `Fp8Weight`s (common/model/fp8.py) of the same slices, read as
stored with the scales of the blocks they overlap; `tensor` always gives a dense tensor.

A checkpoint source can also serve the weights in a rotated latent basis (a TPLA side file,
`use_basis`): gamma folded into kv_b_proj and each layer's R applied, in float64 as
`common.tpla.convert` does, so the result equals rotating the loaded model.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from common.loading.checkpoint import CheckpointError, CheckpointReader
from common.loading.text_names import served_name
from common.model.args import ModelConfig
from common.model.causal_lm import DeepseekForCausalLM
from common.model.fp8 import (
    Fp8Weight,
    RowRun,
    Weight,
    cat_rows,
    stack,
)
from common.model.int4 import Int4Weight, cat_int4_rows, stack_int4
from common.model.mtp import SHARED_WITH_MAIN, MTPLayer

ALL = slice(None)
_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_LAYER_PREFIX = re.compile(r"^model\.layers\.\d+\.")
_LATENT = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\.(kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj)\.weight$"
)


class WeightSource(Protocol):
    """Tensors by parameter name, sliced, in the serving dtype unless `dtype` names another
    (fresh tensors, owned by the caller). A tensor read in another dtype is converted from
    the stored values once, never through the serving dtype."""

    config: ModelConfig

    def tensor(
        self, name: str, rows: slice = ALL, cols: slice = ALL, dtype: torch.dtype | None = None
    ) -> Tensor:
        """name[rows, cols] (a 1-D tensor takes `rows` only)."""

    def has(self, name: str) -> bool:
        """Whether the source holds a (non-expert) tensor of this name."""

    def linear(self, name: str, rows: slice = ALL, cols: slice = ALL) -> Weight:
        """A linear weight's name[rows, cols]: kept in FP8 where the source keeps it so."""

    def gate_up(self, prefix: str, cols: slice = ALL, experts: slice = ALL) -> Weight:
        """Experts `experts`' gate rows `cols` then up rows `cols`: [|experts|, 2 |cols|, D]."""

    def down(self, prefix: str, cols: slice = ALL, experts: slice = ALL) -> Weight:
        """Experts `experts`' down_proj columns `cols`: [|experts|, D, |cols|]."""


def kept_float32(name: str) -> bool:
    """A tensor read in float32 whatever the serving dtype: a MoE router's, since its scores
    (and V3's correction bias) pick the experts, and a DSA indexer's head weights, which HF
    keeps in float32 (its scores pick the attended tokens)."""
    return name.endswith(
        (
            "mlp.gate.weight",
            "mlp.gate.e_score_correction_bias",
            "self_attn.indexer.weights_proj.weight",
        )
    )


def rotate_kv_a(kv_a: Tensor, r: Tensor) -> Tensor:
    """kv_a_proj_with_mqa with its latent rows (the first d_c) mapped to R^T x; fp64 math."""
    d_c = r.shape[0]
    a = kv_a.to(torch.float64).clone()
    a[:d_c] = r.to(torch.float64).T @ a[:d_c]
    return a.to(kv_a.dtype)


def rotate_kv_b(kv_b: Tensor, gamma: Tensor, r: Tensor) -> Tensor:
    """(kv_b_proj rows) x diag(gamma) x R: gamma folded, latent columns rotated; fp64 math."""
    b = kv_b.to(torch.float64) * gamma.to(torch.float64)[None, :]
    return (b @ r.to(torch.float64)).to(kv_b.dtype)


class ModelWeights:
    """A loaded model as a `WeightSource` (slices are copied out of its parameters)."""

    def __init__(self, model: DeepseekForCausalLM) -> None:
        self.config = model.config
        self._params = {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()}

    def tensor(
        self, name: str, rows: slice = ALL, cols: slice = ALL, dtype: torch.dtype | None = None
    ) -> Tensor:
        t = self._params[name][rows]
        t = t[:, cols] if t.ndim == 2 else t
        return t.clone() if dtype is None else t.to(dtype, copy=True)

    def has(self, name: str) -> bool:
        return name in self._params

    def linear(self, name: str, rows: slice = ALL, cols: slice = ALL) -> Weight:
        return self.tensor(name, rows, cols)

    def gate_up(self, prefix: str, cols: slice = ALL, experts: slice = ALL) -> Tensor:
        gu = self._params[f"{prefix}.gate_up_proj"][experts]
        inter = gu.shape[1] // 2
        return torch.cat((gu[:, :inter][:, cols], gu[:, inter:][:, cols]), dim=1)

    def down(self, prefix: str, cols: slice = ALL, experts: slice = ALL) -> Tensor:
        return self._params[f"{prefix}.down_proj"][experts][:, :, cols].clone()


class CheckpointWeights:
    """A checkpoint directory as a `WeightSource`; its names and shapes are checked against
    the config up front, every mismatch named in one `CheckpointError`."""

    def __init__(
        self,
        model_dir: str | Path,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        keep_fp8: bool = False,
        mtp: bool = False,
    ) -> None:
        self.config = ModelConfig.from_dir(model_dir)
        # DeepSeek-V3's MTP modules are layers num_hidden_layers + k; served only when asked.
        self.mtp = mtp
        layers = self.config.num_hidden_layers + self.mtp_layers
        self.reader = CheckpointReader(model_dir)
        self.dtype, self.device = dtype, torch.device(device)
        self.keep_fp8 = keep_fp8
        self._rotations: list[Tensor] | None = None
        self._plain: dict[str, str] = {}
        self._experts: dict[str, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
        for stored in self.reader.tensors:
            name = served_name(stored, self.config)
            if name is None or name.endswith("rotary_emb.inv_freq") or self.reader.is_scale(stored):
                continue  # not served / derived from the config / read with their weights
            layer = _LAYER.match(name)
            if layer and int(layer.group(1)) >= layers:
                continue  # MTP layers unless asked for (and beyond num_nextn_predict_layers)
            if expert := _EXPERT.match(name):
                self._experts[expert.group(1)][int(expert.group(2))][expert.group(3)] = stored
            else:
                self._plain[name] = stored
        if self.config.tie_word_embeddings and "lm_head.weight" not in self._plain:
            self._plain["lm_head.weight"] = "model.embed_tokens.weight"
        self._validate()

    def use_basis(self, rotations: Sequence[Tensor]) -> None:
        """Serve every layer's latent tensors folded and rotated by its R [d_c, d_c] (the
        model's layers, then as many MTP layers as there are rotations left)."""
        c = self.config
        if not 0 <= len(rotations) - c.num_hidden_layers <= c.num_nextn_predict_layers:
            raise CheckpointError(
                f"{len(rotations)} rotations for {c.num_hidden_layers} layers and "
                f"{c.num_nextn_predict_layers} MTP layers"
            )
        self._rotations = list(rotations)

    # -- WeightSource -------------------------------------------------------------------------

    def tensor(
        self, name: str, rows: slice = ALL, cols: slice = ALL, dtype: torch.dtype | None = None
    ) -> Tensor:
        latent = _LATENT.match(name)
        if latent and self._rotates(int(latent.group(1))):
            return self._rotated(int(latent.group(1)), latent.group(2), rows, cols)
        return self._read(name, rows, cols, dtype=dtype)

    def linear(self, name: str, rows: slice = ALL, cols: slice = ALL) -> Weight:
        stored = self._plain.get(name)
        latent = _LATENT.match(name)
        rotated = latent is not None and self._rotates(int(latent.group(1)))
        if stored is None or rotated or not self._keeps(stored):
            return self.tensor(name, rows, cols)
        return self._quantized(stored, (rows, cols), _role(name))

    def gate_up(self, prefix: str, cols: slice = ALL, experts: slice = ALL) -> Weight:
        fused = f"{prefix}.gate_up_proj"
        role, stored = _role(fused), self._plain.get(fused, fused)
        if fused in self._plain and self._keeps(stored):
            inter = self.reader.tensors[stored].shape[1] // 2
            start, stop, _ = cols.indices(inter)
            gate = self._quantized(stored, (experts, slice(start, stop)), role)
            up = self._quantized(stored, (experts, slice(inter + start, inter + stop)), role)
            return cat_rows(
                [gate, up], (*gate.shape[:-2], 2 * (stop - start), gate.shape[-1]), role
            )
        if fused in self._plain:
            if cols == ALL:
                return self._read(fused, experts)
            inter = self.reader.tensors[stored].shape[1] // 2
            start, stop, _ = cols.indices(inter)
            gate = self._read(fused, experts, slice(start, stop))
            up = self._read(fused, experts, slice(inter + start, inter + stop))
            return torch.cat((gate, up), dim=1)
        held = range(*experts.indices(len(self._experts[prefix])))
        names = [self._experts[prefix][e] for e in held]
        first = self.reader.tensors[names[0]["gate_proj"]].shape
        width = len(range(*cols.indices(first[0])))
        if self._keeps_int4(names[0]["gate_proj"]):
            return stack_int4(
                lambda k: cat_int4_rows(
                    [self._int4(names[k][p], (cols,), role) for p in ("gate_proj", "up_proj")],
                    role,
                ),
                len(names),
                role,
            )
        if self._keeps(names[0]["gate_proj"]):

            def expert(k: int) -> Fp8Weight:
                gate = self._quantized(names[k]["gate_proj"], (cols,), role)
                up = self._quantized(names[k]["up_proj"], (cols,), role)
                return cat_rows([gate, up], (2 * width, first[1]), role)

            return stack(expert, len(names), role)
        out = torch.empty(len(names), 2 * width, first[1], dtype=self.dtype, device=self.device)
        for k, expert in enumerate(names):
            out[k, :width] = self._read_raw(expert["gate_proj"], (cols,))
            out[k, width:] = self._read_raw(expert["up_proj"], (cols,))
        return out

    def down(self, prefix: str, cols: slice = ALL, experts: slice = ALL) -> Weight:
        fused = f"{prefix}.down_proj"
        role = _role(fused)
        if fused in self._plain:
            if self._keeps(self._plain[fused]):
                return self._quantized(self._plain[fused], (experts, ALL, cols), role)
            return self._read(fused, experts, ALL, cols)
        held = range(*experts.indices(len(self._experts[prefix])))
        names = [self._experts[prefix][e] for e in held]
        if self._keeps_int4(names[0]["down_proj"]):
            return stack_int4(
                lambda k: self._int4(names[k]["down_proj"], (ALL, cols), role), len(names), role
            )
        if self._keeps(names[0]["down_proj"]):
            return stack(
                lambda k: self._quantized(names[k]["down_proj"], (ALL, cols), role),
                len(names),
                role,
            )
        first = self.reader.tensors[names[0]["down_proj"]].shape
        width = len(range(*cols.indices(first[1])))
        out = torch.empty(len(names), first[0], width, dtype=self.dtype, device=self.device)
        for k, expert in enumerate(names):
            out[k] = self._read_raw(expert["down_proj"], (ALL, cols))
        return out

    @property
    def mtp_layers(self) -> int:
        """The MTP modules this source serves (0 unless built with `mtp=True`)."""
        return self.config.num_nextn_predict_layers if self.mtp else 0

    def has(self, name: str) -> bool:
        return name in self._plain

    def _rotates(self, layer: int) -> bool:
        """Whether layer `layer`'s latent tensors are served in a rotated basis (a side
        file without the MTP layers leaves them in the checkpoint's basis, still exact)."""
        return self._rotations is not None and layer < len(self._rotations)

    # -- reading --------------------------------------------------------------------------------

    def _keeps(self, stored: str) -> bool:
        """Whether stored tensor `stored` stays FP8 (e5m2 checkpoints are dequantized)."""
        return self.keep_fp8 and self.reader.tensors[stored].dtype == torch.float8_e4m3fn

    def _keeps_int4(self, stored: str) -> bool:
        """Whether routed expert tensor `stored` stays INT4 (where the source keeps its
        quantized weights; any other INT4 tensor is dequantized at load)."""
        return self.keep_fp8 and stored in self.reader.int4

    def _int4(self, stored: str, index: Sequence[slice], role: str) -> Int4Weight:
        q = self.reader.read_int4(stored, index, device=self.device)
        return Int4Weight(q.packed, q.scale, self.reader.quant.group, self.dtype, role)

    def _quantized(self, stored: str, index: Sequence[slice], role: str) -> Fp8Weight:
        q = self.reader.read_quantized(stored, index, device=self.device)
        rows = (RowRun(q.values.shape[-2], q.row_offset, 0),)
        shape = tuple(q.values.shape)
        block = self.reader.quant.block
        return Fp8Weight(q.values, q.scale, rows, q.col_offset, block, shape, self.dtype, role)

    def _read(
        self,
        name: str,
        *index: slice,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> Tensor:
        if name not in self._plain:
            raise CheckpointError(f"missing: {name}")
        return self._read_raw(self._plain[name], index, device, dtype)

    def _read_raw(
        self,
        name: str,
        index: Sequence[slice],
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> Tensor:
        shape = self.reader.tensors[name].shape
        index = tuple(index)[: len(shape)]
        return self.reader.read(
            name, index, dtype=dtype or self.dtype, device=device or self.device
        )

    def _rotated(self, layer: int, leaf: str, rows: slice, cols: slice) -> Tensor:
        """A latent tensor in the rotated basis, computed on the CPU in float64 from tensors
        cast to the serving dtype first (as rotating the loaded model does)."""
        assert self._rotations is not None
        r = self._rotations[layer]
        prefix = f"model.layers.{layer}.self_attn."
        cpu = torch.device("cpu")
        if leaf == "kv_a_layernorm":
            gamma = self._read(prefix + "kv_a_layernorm.weight", rows, device=cpu)
            return torch.ones_like(gamma, device=self.device)
        if leaf == "kv_a_proj_with_mqa":
            # R^T mixes every latent row, so the whole kv_a (d_c + d_r rows x D, the layer's
            # smallest projection) is materialized even when a rank keeps only its slice.
            a = rotate_kv_a(self._read(prefix + "kv_a_proj_with_mqa.weight", device=cpu), r)
            return a[rows, cols].to(self.device).contiguous()
        # R mixes every latent column: the kept rows of kv_b are materialized at full width.
        b = self._read(prefix + "kv_b_proj.weight", rows, device=cpu)
        gamma = self._read(prefix + "kv_a_layernorm.weight", device=cpu)
        return rotate_kv_b(b, gamma, r)[:, cols].to(self.device).contiguous()

    # -- checks ---------------------------------------------------------------------------------

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        """What each parameter's shape would be after the expert tensors are fused."""
        shapes = {k: self.reader.tensors[v].shape for k, v in self._plain.items()}
        n = self.config.n_routed_experts
        for prefix, experts in self._experts.items():
            if sorted(experts) != list(range(n)):
                raise CheckpointError(
                    f"{prefix}: expected experts 0..{n - 1}, found {len(experts)}"
                )
            per: dict[str, set[tuple[int, ...]]] = defaultdict(set)
            for e, names in experts.items():
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    if proj not in names:
                        raise CheckpointError(f"{prefix}.{e}: an expert lacks '{proj}'")
                    per[proj].add(self.reader.tensors[names[proj]].shape)
            if len(per["gate_proj"] | per["up_proj"]) != 1 or len(per["down_proj"]) != 1:
                raise CheckpointError(f"{prefix}: experts of different shapes")
            (inter, hidden), (down,) = next(iter(per["gate_proj"])), per["down_proj"]
            shapes[f"{prefix}.gate_up_proj"] = (n, 2 * inter, hidden)
            shapes[f"{prefix}.down_proj"] = (n, *down)
        return shapes

    def _validate(self) -> None:
        with torch.device("meta"):
            model = DeepseekForCausalLM(self.config)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        found = self._shapes()
        optional = {name for name, _ in SHARED_WITH_MAIN}
        for k in range(self.mtp_layers):
            index = self.config.num_hidden_layers + k
            with torch.device("meta"):
                layer = MTPLayer(self.config, index)
            prefix = f"model.layers.{index}."
            for name, value in layer.state_dict().items():
                if prefix + name in found or name not in optional:
                    expected[prefix + name] = tuple(value.shape)
        missing = sorted(set(expected) - set(found))
        unexpected = sorted(set(found) - set(expected))
        misshaped = [
            f"{k}: checkpoint {found[k]} vs model {v}"
            for k, v in expected.items()
            if k in found and found[k] != v
        ]
        if missing or unexpected or misshaped:
            lines = (
                [f"missing: {k}" for k in missing[:20]]
                + [f"unexpected: {k}" for k in unexpected[:20]]
                + misshaped[:20]
            )
            raise CheckpointError(
                f"{self.reader.model_dir} does not match its config.json:\n  " + "\n  ".join(lines)
            )


def _role(name: str) -> str:
    """A weight's name without its layer: the workspace buffer it dequantizes into."""
    return _LAYER_PREFIX.sub("", name)
