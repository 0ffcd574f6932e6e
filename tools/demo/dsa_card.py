"""The DSA demo's model card, written from its training report (tools/demo/train_dsa.py)."""

from __future__ import annotations

from typing import Any


def dsa_card(r: dict[str, Any], config: dict[str, Any]) -> str:
    c, a = r["config"], r["agreement"]
    tune, index = r["finetune"], r["indexer"]
    greedy = a["greedy"]
    rows = "\n".join(
        f"| {n} | {g['identical_continuations']:.0%} | {g['token_agreement']:.1%} | "
        f"{a['fp8_engine_identical_continuations'][n]:.0%} |"
        for n, g in greedy.items()
    )
    last_loss = tune["history"][-1]["loss"]
    first_kl, last_kl = index["history"][0]["kl"], index["history"][-1]["kl"]
    ppl = a["perplexity_2048"]
    return f"""# tpla-serve DSA demo model (DeepSeek-V3.2 architecture)

The demo model (`{r["source"]}`, DeepSeek-V2, trained by `tpla train-demo`) made into
DeepSeek-V3.2's architecture on CPU, so DeepSeek Sparse Attention can be served and measured
offline: `TPLA_MODEL=models/demo-dsa make serve`.

## Architecture
`model_type: deepseek_v32`: the demo's 4 layers, hidden 256, 8 heads, MLA (d_c 128, d_n 32,
d_r 16, d_v 32) and MoE (8 routed experts, top-2, 1 shared; V3's sigmoid router), plus a
**q-LoRA** of rank {config["q_lora_rank"]} and a **lightning indexer** in every layer
({config["index_n_heads"]} heads of {config["index_head_dim"]} dims); each query attends
over the **{config["index_topk"]}** tokens its layer's indexer scores highest (V3.2: 2048),
so sparsity decides what a query reads from a few dozen tokens on. No MTP layer. Weights bf16.

## How it was made (`tpla train-demo --dsa`, tools/demo/train_dsa.py)
1. The q-LoRA is **factored from the demo's query projection** (SVD, rank {c["q_lora_rank"]};
   the norm's gamma the mean rms of q_a x, so the product starts near q_proj), the router
   takes V3's sigmoid scores on its old weights; then everything but the indexers is
   **fine-tuned** with dense attention: {c["finetune_steps"]} steps of {c["batch_size"]} x
   {c["seq_len"]} tokens, lr {c["lr"]} cosine ({tune["minutes"]} wall-clock minutes on the
   shared 2-core VM; final training loss {last_loss:.3f}).
2. The indexers are **warmed up as DeepSeek did V3.2's**: the model frozen, each layer's
   indexer trained to match its layer's dense attention distribution (the heads'
   probabilities summed and L1-normalized; KL divergence over each query's past):
   {c["indexer_steps"]} steps of {c["indexer_batch_size"]} x {c["indexer_seq_len"]} tokens, lr
   {c["indexer_lr"]} cosine ({index["minutes"]} minutes; KL {first_kl:.3f} -> {last_kl:.3f}).

## Agreement with its own dense attention
The same weights with index_topk above the context are the model's dense attention.
{len(greedy)} prompt lengths x {a["prompts_per_length"]} held-out prompts (the demo corpus's eval
split), 32 greedy tokens each: "identical" is the share of continuations equal token for
token; "agreement" the share of positions whose greedy token agrees when both read the dense
continuation; "fp8 keys" the share of the decode engine's continuations with
`TPLA_INDEX_CACHE_DTYPE=fp8` identical to its continuations with the keys in the model's dtype.

| prompt tokens | identical | agreement | fp8 keys: identical |
|---|---|---|---|
{rows}

Perplexity over 4 held-out windows of 2048 tokens: {ppl["sparse"]:.2f} sparse, {ppl["dense"]:.2f}
dense. The fp8 keys keep {a["fp8_topk_overlap"]:.1%} of a query's top-{config["index_topk"]}
(every layer, the queries of a 2048-token window past index_topk).
The full record is `dsa_training_report.json`.
"""
