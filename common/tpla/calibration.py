"""Calibration: per-layer second moments E[n n^T] of the cached latent over real text.

The layers are the model's, then its MTP modules' when given (common/model/mtp.py): each
module runs over a window's positions that have its next tokens, fed the previous stage's
hidden states, as the prefill worker runs it.

The latent the cache stores after gamma folding is `n = x / rms(x)` (no gamma), where `x` is
the latent half of `kv_a_proj_with_mqa`. A forward pre-hook on each layer's
`kv_a_layernorm` sees exactly that `x` during the model's own prefill, so the statistics
come from the real forward without touching the model code. Accumulation is float64: the
PCA basis and the per-shard energies are derived from these sums.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm import tqdm

from common.model.causal_lm import DeepseekForCausalLM
from common.model.mtp import MTPLayer, mtp_prefill
from common.tpla import corpus

DEFAULT_CALIB_CHARS = 200_000


class CalibrationError(ValueError):
    """Calibration input is missing, unreadable or too short."""


@dataclass(frozen=True)
class TextSource:
    """Text to calibrate or evaluate on and a human-readable note of where it came from."""

    text: str
    source: str


@dataclass(frozen=True)
class LatentStatistics:
    """Per layer: sum over tokens of n n^T (float64, d_c x d_c), and the token count."""

    sums: tuple[Tensor, ...]
    tokens: int
    source: str
    # The MTP modules' latents seen (the last len(mtp_tokens) sums; a window of W tokens
    # gives module k W - k - 1 positions).
    mtp_tokens: tuple[int, ...] = ()

    @property
    def mtp_layers(self) -> int:
        return len(self.mtp_tokens)

    def second_moments(self) -> list[Tensor]:
        """E[n n^T] per layer (the model's, then the MTP modules')."""
        counts = [self.tokens] * (len(self.sums) - self.mtp_layers) + list(self.mtp_tokens)
        if min(counts, default=0) == 0:
            raise CalibrationError("no calibration tokens were seen")
        return [s / n for s, n in zip(self.sums, counts, strict=True)]

    def diagonal_spectra(self) -> list[Tensor]:
        """E[n_k^2] per layer in the checkpoint's own (unrotated) basis."""
        return [torch.diagonal(c).clone() for c in self.second_moments()]


def load_text(
    path: str | Path | None, max_chars: int, split: corpus.Split = corpus.Split.CALIBRATION
) -> TextSource:
    """Text from a file, a folder (its files, sorted) or, by default, a demo corpus split."""
    if max_chars <= 0:
        raise CalibrationError(f"max_chars must be positive, got {max_chars}")
    if path is None:
        text = corpus.split_text(split, max_chars=max_chars)
        source = f"demo corpus {split.value} split, first {max_chars} chars"
    else:
        root = Path(path)
        if root.is_file():
            files = [root]
        elif root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.is_file())
        else:
            raise CalibrationError(f"text path {root} does not exist")
        parts: list[str] = []
        size = 0
        for file in files:
            try:
                part = file.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # binary or unreadable files in a folder are not text
            parts.append(part)
            size += len(part)
            if size >= max_chars:
                break
        text = corpus.FILE_SEPARATOR.join(parts)[:max_chars]
        source = f"{root}, first {max_chars} chars"
    if not text.strip():
        raise CalibrationError(f"the text is empty ({source})")
    return TextSource(text, source)


def token_windows(ids: Sequence[int], window: int, min_len: int = 2) -> list[Tensor]:
    """Non-overlapping windows of at most `window` tokens (the last may be shorter)."""
    if window < 1:
        raise CalibrationError(f"window must be positive, got {window}")
    out = [
        torch.tensor(list(ids[start : start + window]), dtype=torch.long)
        for start in range(0, len(ids), window)
    ]
    return [w for w in out if len(w) >= min_len]


@contextlib.contextmanager
def accumulate_latents(norm: nn.Module, total: Tensor) -> Iterator[None]:
    """While open, each input x of a layer's `kv_a_layernorm` (its latent before the norm)
    adds sum n n^T over its rows (n = x / rms(x), float64, on the CPU) to `total` in place."""
    eps = float(norm.eps)
    d_c = total.shape[0]

    def hook(_module: nn.Module, args: tuple[Tensor, ...]) -> None:
        x = args[0].detach().to(torch.float64).reshape(-1, d_c)
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        total.add_((n.T @ n).cpu())

    handle = norm.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def collect_latent_statistics(
    model: DeepseekForCausalLM,
    windows: Sequence[Tensor],
    *,
    source: str = "",
    progress: bool = True,
    mtp_layers: Sequence[MTPLayer] = (),
) -> LatentStatistics:
    """Run exact prefill over `windows` and accumulate sum n n^T per layer (float64), the
    MTP modules' after the model's: a loaded model's statistics (`tpla eval` calibrates the
    model it evaluates). A checkpoint's, without loading it: common/tpla/layer_calibration.py,
    which a test holds bit-equal to this."""
    if not windows:
        raise CalibrationError("no calibration windows (is the text shorter than 2 tokens?)")
    d_c = model.config.kv_lora_rank
    layers = [*model.model.layers, *mtp_layers]
    sums = [torch.zeros(d_c, d_c, dtype=torch.float64) for _ in layers]
    tokens = 0
    mtp_tokens = [0] * len(mtp_layers)
    device = model.lm_head.weight.device
    with contextlib.ExitStack() as hooks:
        for layer, total in zip(layers, sums, strict=True):
            hooks.enter_context(accumulate_latents(layer.self_attn.kv_a_layernorm, total))
        for window in tqdm(
            windows, desc="calibrate", unit="win", file=sys.stderr, disable=not progress
        ):
            window = window.to(device)
            out = model.prefill(window, [len(window)])
            tokens += len(window)
            hidden = out.hidden
            for k, layer in enumerate(mtp_layers):
                rows = len(window) - k - 1
                if rows <= 0 or hidden is None:
                    break
                with torch.inference_mode():
                    step = mtp_prefill(
                        layer, model.rope, window[k + 1 :], hidden[:rows], [rows], all_logits=True
                    )
                hidden = step.hidden
                mtp_tokens[k] += rows
    return LatentStatistics(tuple(sums), tokens, source, tuple(mtp_tokens))
