"""The demo model's card (its README.md), written from its training report."""

from __future__ import annotations

import platform
from typing import Any


def model_card(r: dict[str, Any]) -> str:
    m, a = r["metrics"], r["arch"]
    params = r["parameters"] / 1e6
    d_n = a["qk_nope_head_dim"]
    experts = (
        f"{a['n_routed_experts']} routed experts, top-{a['experts_per_token']}, "
        f"{a['n_shared_experts']} shared"
    )
    return f"""# tpla-serve demo model (DeepSeek-V2 architecture, {params:.1f}M parameters)

A small MLA + MoE model trained from scratch on CPU by `tpla train-demo`, so the serving
stack, TPLA fidelity measurements and demos work offline. It writes Python, not prose.

## Architecture
DeepSeek-V2 (`model_type: deepseek_v2`): {a["num_layers"]} layers (1 dense, then MoE with
{experts}), hidden {a["hidden_size"]}, {a["num_heads"]} heads, MLA with `kv_lora_rank`
{4 * d_n} (= 4 x `qk_nope_head_dim` {d_n}), `qk_rope_head_dim` {a["qk_rope_head_dim"]},
`v_head_dim` {a["v_head_dim"]}, `q_lora_rank` null, vocab {a["vocab_size"]} (byte-level BPE),
context {a["max_position_embeddings"]}. Weights stored in bf16; load as fp32.

## Data
The standard-library `.py` sources of Python {platform.python_version()}, split by a hash of
each file's relative path: 90% train, 5% calibration, 5% eval
(`common.tpla.corpus.calibration_text()` / `eval_text()` rebuild the held-out text on any
machine with this Python version). About 10% of training documents are chat-formatted
(user: a docstring's first line; assistant: the function), so the chat template means
something.

## Training
{r["steps"]} steps of {r["train"]["batch_size"]} x {r["train"]["seq_len"]} tokens
({r["tokens_seen"] / 1e6:.2f}M tokens): {r["minutes"]} minutes of wall-clock step time and
{r.get("cpu_minutes", 0)} CPU-minutes (2 torch threads; the machine's 2 cores were shared with
other work during training, so wall-clock minutes overstate the compute). AdamW (peak lr
{r["train"]["lr"]}, warmup then cosine over the time budget), expert balance loss 0.01.

## Held-out evaluation
First {int(m["eval_bytes"]):,} bytes of the {r["eval_source"]} ({int(m["eval_tokens"]):,} tokens),
non-overlapping {r["train"]["seq_len"]}-token windows, exported bf16 weights:

| model | perplexity (per token) | bits per byte |
|---|---|---|
| this model | {m["perplexity"]:.2f} | {m["bits_per_byte"]:.3f} |
| unigram (train-split token frequencies) | - | {m["unigram_bits_per_byte"]:.3f} |
| gzip -9 | - | {m["gzip_bits_per_byte"]:.3f} |

Made with `tpla train-demo --out models/demo --minutes {r["minutes"]:.0f}`; the full record is in
`training_report.json`.
"""
