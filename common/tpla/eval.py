"""`tpla eval`: teacher-forced perplexity of MLA, GLA, TPLA and TPLA-PD on held-out text.

Every variant runs through the oracle (`common.tpla.reference`) over the same windows of
`window` tokens and is scored on the same positions: in each window, the logits at positions
`prefill_len .. len-2` predicting tokens `prefill_len+1 .. len-1`. For `tpla-pd` those are
exactly the decode-time predictions after an exact MLA prefill of the first `prefill_len`
tokens; for `tpla` the prefix is sliced too, as in the paper's plain TPLA rows.

Bases come from the model directory's side files (`tpla_<method>.json`) when present;
otherwise the model is calibrated once on the calibration split and every method's basis
and spectrum is derived from those statistics.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from common.loading.loader import load_model
from common.loading.side_file import Method, load_side_file, side_file_name
from common.model.causal_lm import DeepseekForCausalLM
from common.parallel import RmsNormMode
from common.text.tokenizer import Tokenizer
from common.tpla import corpus
from common.tpla.calibration import (
    DEFAULT_CALIB_CHARS,
    LatentStatistics,
    collect_latent_statistics,
    load_text,
    token_windows,
)
from common.tpla.convert import apply_reparameterization, build_reparameterization
from common.tpla.reference import AttentionSpec, ReferenceModel, Variant

DEFAULT_WINDOW = 1024
# Code tokenizes to roughly 3-4 characters per token; read generously, then cut to the budget.
_CHARS_PER_TOKEN = 8


@dataclass(frozen=True)
class EvalConfig:
    """What `evaluate` measures and on which text."""

    groups: int
    prefill_len: int = 256
    max_tokens: int = 8192
    window: int | None = None  # None: the training length from training_report.json, or 1024
    seed: int = 0
    calib_path: str | None = None
    calib_chars: int | None = None  # None: DEFAULT_CALIB_CHARS
    eval_path: str | None = None
    progress: bool = True
    device: str = "cpu"  # resolved (`common.runtime.settings.placed`): cpu, cuda or cuda:N
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ValueError(f"--groups must be >= 1, got {self.groups}")
        if self.prefill_len < 0:
            raise ValueError(f"--prefill-len must be >= 0, got {self.prefill_len}")
        if self.max_tokens < 2:
            raise ValueError(f"--max-tokens-eval must be >= 2, got {self.max_tokens}")


@dataclass(frozen=True)
class VariantKey:
    """One row of the fidelity table."""

    variant: Variant
    method: Method | None = None
    rmsnorm: RmsNormMode | None = None


@dataclass(frozen=True)
class VariantResult:
    key: VariantKey
    ppl: float


@dataclass(frozen=True)
class EvalReport:
    groups: int
    window: int
    prefill_len: int
    scored_tokens: int
    bases: tuple[tuple[str, str], ...]  # (method, where its basis and spectrum came from)
    results: tuple[VariantResult, ...]

    def contract(self) -> dict[str, Any]:
        """The `--json` line: exactly {"groups", "results": [{variant, method, rmsnorm, ppl}]}."""
        return {
            "groups": self.groups,
            "results": [
                {
                    "variant": r.key.variant.value,
                    "method": r.key.method.value if r.key.method else None,
                    "rmsnorm": r.key.rmsnorm.value if r.key.rmsnorm else None,
                    "ppl": r.ppl,
                }
                for r in self.results
            ],
        }


def variant_grid() -> list[VariantKey]:
    """mla, gla, then tpla and tpla-pd for every method x RMSNorm mode."""
    keys = [VariantKey(Variant.MLA), VariantKey(Variant.GLA)]
    for variant in (Variant.TPLA, Variant.TPLA_PD):
        keys += [VariantKey(variant, m, mode) for m in Method for mode in RmsNormMode]
    return keys


def default_window(model_dir: Path, max_positions: int) -> int:
    """The demo trainer's sequence length when recorded, else 1024, within the context."""
    report = model_dir / "training_report.json"
    window = DEFAULT_WINDOW
    if report.is_file():
        try:
            window = int(json.loads(report.read_text())["train"]["seq_len"])
        except (KeyError, TypeError, ValueError, json.JSONDecodeError):
            window = DEFAULT_WINDOW
    return min(window, max_positions)


def window_nll(logits: Tensor, ids: Tensor, prefill_len: int) -> tuple[float, int]:
    """Summed NLL (nats) of the scored predictions of one window and their count."""
    if len(ids) - 1 <= prefill_len:
        return 0.0, 0
    pred = logits[prefill_len : len(ids) - 1].float()
    target = ids[prefill_len + 1 :]
    return float(F.cross_entropy(pred, target, reduction="sum")), int(target.numel())


def _method_models(
    base: DeepseekForCausalLM, model_dir: Path, config: EvalConfig, window: int
) -> tuple[dict[Method, tuple[DeepseekForCausalLM, list[Tensor]]], tuple[tuple[str, str], ...]]:
    stats: LatentStatistics | None = None
    models: dict[Method, tuple[DeepseekForCausalLM, list[Tensor]]] = {}
    bases: list[tuple[str, str]] = []
    for method in Method:
        path = model_dir / side_file_name(method)
        if path.is_file():
            side = load_side_file(path)
            bases.append(
                (method.value, f"side file {path.name} ({side.calibration_tokens} tokens)")
            )
        else:
            if stats is None:
                text = load_text(config.calib_path, config.calib_chars or DEFAULT_CALIB_CHARS)
                tok = Tokenizer.from_dir(model_dir)
                calib = token_windows(tok.encode(text.text, add_bos=False), window)
                stats = collect_latent_statistics(
                    base, calib, source=text.source, progress=config.progress
                )
            side = build_reparameterization(base, method, stats, seed=config.seed)
            bases.append(
                (method.value, f"calibrated now ({stats.tokens} tokens of {stats.source})")
            )
        model = copy.deepcopy(base)
        spectra = apply_reparameterization(model, side)
        models[method] = (model, spectra)
    return models, tuple(bases)


def evaluate(model_dir: str | Path, config: EvalConfig) -> EvalReport:
    """Perplexity of every variant in `variant_grid()` on the eval text."""
    model_dir = Path(model_dir)
    base = load_model(model_dir, dtype=config.dtype, device=config.device)
    c = base.config
    if c.kv_lora_rank % config.groups or c.num_attention_heads % config.groups:
        raise ValueError(
            f"--groups {config.groups} must divide the latent width {c.kv_lora_rank} and the "
            f"{c.num_attention_heads} heads (GLA splits both)"
        )
    window = config.window or default_window(model_dir, c.max_position_embeddings)
    if window > c.max_position_embeddings:
        raise ValueError(f"--window {window} exceeds the context of {c.max_position_embeddings}")
    if config.prefill_len >= window - 1:
        raise ValueError(
            f"--prefill-len {config.prefill_len} leaves nothing to score in windows of {window}"
        )
    tok = Tokenizer.from_dir(model_dir)
    text = load_text(config.eval_path, config.max_tokens * _CHARS_PER_TOKEN, corpus.Split.EVAL)
    ids = tok.encode(text.text, add_bos=False)[: config.max_tokens]
    windows = [
        w.to(config.device) for w in token_windows(ids, window) if len(w) - 1 > config.prefill_len
    ]
    if not windows:
        raise ValueError(
            f"the eval text has {len(ids)} tokens: too few to score after --prefill-len "
            f"{config.prefill_len}"
        )
    models, bases = _method_models(base, model_dir, config, window)
    keys = variant_grid()
    results = []
    bar = tqdm(
        total=len(keys) * len(windows),
        desc=f"eval r={config.groups}",
        unit="win",
        file=sys.stderr,
        disable=not config.progress,
    )
    scored = 0
    for key in keys:
        model, spectra = (base, None) if key.method is None else models[key.method]
        spec = AttentionSpec(key.variant, config.groups, key.rmsnorm or RmsNormMode.EXACT)
        oracle = ReferenceModel(model, spec, spectra)
        nll, count = 0.0, 0
        for w in windows:
            logits = oracle.forward(w, prefill_len=config.prefill_len)
            part, n = window_nll(logits, w, config.prefill_len)
            nll, count = nll + part, count + n
            bar.update(1)
        scored = count
        results.append(VariantResult(key, math.exp(nll / count)))
        bar.set_postfix(last=f"{key.variant.value} {results[-1].ppl:.3f}")
    bar.close()
    return EvalReport(config.groups, window, config.prefill_len, scored, bases, tuple(results))


def format_table(report: EvalReport) -> str:
    """A plain-text table in the layout of the paper's Table 1."""
    lines = [
        f"r = {report.groups}: perplexity over {report.scored_tokens} tokens "
        f"(windows of {report.window}, scored after {report.prefill_len} prompt tokens)",
        f"{'variant':<9} {'method':<9} {'rmsnorm':<8} {'ppl':>10}",
    ]
    for r in report.results:
        k = r.key
        lines.append(
            f"{k.variant.value:<9} {(k.method.value if k.method else '-'):<9} "
            f"{(k.rmsnorm.value if k.rmsnorm else '-'):<8} {r.ppl:>10.4f}"
        )
    lines += [f"basis {m}: {src}" for m, src in report.bases]
    return "\n".join(lines)
