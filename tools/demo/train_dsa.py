"""`tpla train-demo --dsa`: the DSA demo, a DeepSeek-V3.2-architecture model made from the
demo model (models/demo, DeepSeek-V2, no q-LoRA) on CPU.

Lifecycle: the demo's weights -> V3.2's architecture (a q-LoRA factored from the query
projection by SVD, the norm's gamma set to the mean rms so the product starts near the old
projection; V3's sigmoid router on the same router weights; a random indexer per layer; no
MTP layer) -> a brief fine-tune of everything but the indexers with dense attention (the
q-LoRA's per-token norm and the router's weights are new) -> the indexers' warm-up as
DeepSeek did V3.2's: the model frozen, each layer's indexer trained to match its dense
attention's distribution (the heads' probabilities summed and L1-normalized; KL divergence)
-> export with index_topk 64 (sparsity matters at the demo's prompt lengths) and the
measured agreement with the model's own dense attention (tools/demo/dsa_eval.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.model.args import ModelConfig
from common.model.causal_lm import DeepseekForCausalLM
from common.model.mla import MLAttention
from tools.demo.train import TrainConfig, lm_loss, prepare_data, save_hub_weights

COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclass(frozen=True)
class DsaDemoConfig:
    source: Path = Path("models/demo")
    out: Path = Path("models/demo-dsa")
    work_dir: Path = Path("runs/train-dsa-demo")
    q_lora_rank: int = 128
    index_topk: int = 64
    index_n_heads: int = 8
    index_head_dim: int = 64
    finetune_steps: int = 150
    indexer_steps: int = 300
    seq_len: int = 512
    batch_size: int = 4
    # The indexers learn at the base model's training context (its attention at 1024).
    indexer_seq_len: int = 1024
    indexer_batch_size: int = 2
    lr: float = 1e-3
    indexer_lr: float = 3e-3
    eval_prompts: int = 8  # per prompt length
    seed: int = 0


def dsa_config(source: dict[str, Any], cfg: DsaDemoConfig, index_topk: int) -> dict[str, Any]:
    """The demo's config as DeepSeek-V3.2's architecture."""
    raw = {k: v for k, v in source.items() if k not in ("num_key_value_heads",)}
    raw.update(
        model_type="deepseek_v32",
        architectures=["DeepseekV32ForCausalLM"],
        q_lora_rank=cfg.q_lora_rank,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        index_topk=index_topk,
        index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim,
        num_nextn_predict_layers=0,
    )
    raw.pop("rope_interleave", None)
    return raw


def convert(
    source: DeepseekForCausalLM, config: ModelConfig, inputs: list[torch.Tensor]
) -> DeepseekForCausalLM:
    """The V3.2-architecture model from the demo's weights: every tensor the two share, a
    q-LoRA per layer from the SVD of q_proj, its norm's gamma the mean rms of q_a x over the
    layer's sampled `inputs` (so q_b(norm(q_a x)) starts near q_proj x), the router as it
    was, a random indexer."""
    model = DeepseekForCausalLM(config)
    state, old = model.state_dict(), source.state_dict()
    shared = {k: v for k, v in old.items() if k in state and state[k].shape == v.shape}
    model.load_state_dict(shared, strict=False)
    pairs = zip(model.decoder_layers(), source.decoder_layers(), inputs, strict=True)
    for new, was, x in pairs:
        q_a, q_b = _factored(was.self_attn.q_proj.weight.detach(), config.q_lora_rank or 0)
        attn = new.self_attn
        with torch.no_grad():
            attn.q_a_proj.weight.copy_(q_a)
            attn.q_b_proj.weight.copy_(q_b)
            rms = (x.float() @ q_a.T).pow(2).mean(-1).sqrt().mean()
            attn.q_a_layernorm.weight.fill_(float(rms))
            gate = getattr(new.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.zero_()
            _init_indexer(attn)
    return model


def _factored(w: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, D] ~ q_b @ q_a with q_a [rank, D], q_b [out, rank] (SVD, the singular values
    split evenly)."""
    u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
    root = s[:rank].sqrt()
    return (root[:, None] * vh[:rank]).float(), (u[:, :rank] * root[None]).float()


def _init_indexer(attn: MLAttention) -> None:
    indexer = attn.indexer
    assert indexer is not None
    for name, p in indexer.named_parameters():
        if "k_norm" in name:
            p.fill_(1.0 if name.endswith("weight") else 0.0)
        else:
            p.normal_(0.0, 0.02)


def _q_inputs(model: DeepseekForCausalLM, windows: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, the rows q_proj reads over `windows`."""
    seen: list[torch.Tensor] = []

    def hook(module: torch.nn.Module, args: tuple[torch.Tensor], out: torch.Tensor) -> None:
        seen.append(args[0].detach())

    hooks = [layer.self_attn.q_proj.register_forward_hook(hook) for layer in model.decoder_layers()]
    with torch.no_grad():
        lm_loss(model, windows)
    for h in hooks:
        h.remove()
    return seen


def finetune(
    model: DeepseekForCausalLM, stream: torch.Tensor, cfg: DsaDemoConfig
) -> list[dict[str, float]]:
    """Every weight but the indexers, on dense attention (the model is built with an
    index_topk above the window), cosine-decayed."""
    params = [p for n, p in model.named_parameters() if ".indexer." not in n]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = random.Random(cfg.seed)
    history = []
    model.train()
    for step in range(cfg.finetune_steps):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / cfg.finetune_steps))
        loss = lm_loss(model, _windows(stream, cfg, rng))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 10 == 0 or step == cfg.finetune_steps - 1:
            history.append({"step": step, "loss": float(loss.detach())})
            print(f"fine-tune step {step}: loss {history[-1]['loss']:.3f}", flush=True)
    model.eval()
    return history


def _windows(
    stream: torch.Tensor, cfg: DsaDemoConfig, rng: random.Random, indexer: bool = False
) -> torch.Tensor:
    """[batch, seq + 1] random windows of the stream (the indexer stage's sizes or not)."""
    seq = cfg.indexer_seq_len if indexer else cfg.seq_len
    batch = cfg.indexer_batch_size if indexer else cfg.batch_size
    starts = [rng.randrange(0, len(stream) - seq - 1) for _ in range(batch)]
    return torch.stack([stream[s : s + seq + 1] for s in starts]).long()


def train_indexers(
    model: DeepseekForCausalLM, stream: torch.Tensor, cfg: DsaDemoConfig
) -> list[dict[str, float]]:
    """Every layer's indexer against its frozen layer's dense attention distribution."""
    from tools.demo.dsa_eval import layer_targets

    params = [p for n, p in model.named_parameters() if ".indexer." in n]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.indexer_lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(cfg.seed + 1)
    history = []
    for step in range(cfg.indexer_steps):
        for group in opt.param_groups:
            group["lr"] = cfg.indexer_lr * 0.5 * (1 + math.cos(math.pi * step / cfg.indexer_steps))
        losses = []
        for window in _windows(stream, cfg, rng, indexer=True)[:, :-1]:
            for attn, x, q_latent, cos_sin, target in layer_targets(model, window):
                losses.append(_indexer_kl(attn, x, q_latent, cos_sin, target))
        loss = torch.stack(losses).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == cfg.indexer_steps - 1:
            history.append({"step": step, "kl": float(loss.detach())})
            print(f"indexer step {step}: KL {history[-1]['kl']:.3f}", flush=True)
    return history


def _indexer_kl(
    attn: MLAttention,
    x: torch.Tensor,
    q_latent: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    target: torch.Tensor,
) -> torch.Tensor:
    """KL(target || softmax of the index scores) over each query's causal past, averaged."""
    indexer = attn.indexer
    assert indexer is not None
    cos, sin = cos_sin
    q = indexer.queries(q_latent, cos, sin)  # [T, H_I, d_I]
    k = indexer.keys(x, cos, sin)  # [T, d_I]
    w = indexer.head_weights(x)  # [T, H_I]
    scores = torch.einsum(
        "th,ths->ts", w, torch.einsum("thd,sd->ths", q, k).mul(indexer.scale).relu()
    )
    causal = torch.ones_like(scores, dtype=torch.bool).tril()
    log_p = scores.masked_fill(~causal, -torch.inf).log_softmax(-1)
    kl = target * (target.clamp(min=1e-12).log() - log_p.masked_fill(~causal, 0.0))
    return kl.sum(-1).mean()


def run(cfg: DsaDemoConfig) -> dict[str, Any]:
    """Convert, fine-tune, warm the indexers up, export and measure."""
    from common.loading.loader import load_model
    from tools.demo.dsa_eval import agreement_report, write_card

    torch.manual_seed(cfg.seed)
    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(cfg.source / "tokenizer.json", cfg.work_dir / "tokenizer.json")
    _, streams = prepare_data(TrainConfig(out=cfg.out, work_dir=cfg.work_dir))
    source = load_model(cfg.source)
    raw = json.loads((cfg.source / "config.json").read_text())
    rng = random.Random(cfg.seed)
    t0 = time.perf_counter()
    inputs = _q_inputs(source, _windows(streams["train"], cfg, rng))
    dense_raw = dsa_config(raw, cfg, index_topk=cfg.seq_len + 1)
    model = convert(source, ModelConfig.from_hf_dict(dense_raw), inputs)
    tune = finetune(model, streams["train"], cfg)
    t1 = time.perf_counter()
    index = train_indexers(model, streams["train"], cfg)
    t2 = time.perf_counter()
    final = dsa_config(raw, cfg, index_topk=cfg.index_topk)
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "config.json").write_text(json.dumps(final, indent=2) + "\n")
    save_hub_weights(model, cfg.out / "model.safetensors")
    for name in COPIED:
        shutil.copy(cfg.source / name, cfg.out / name)
    report = {
        "source": str(cfg.source),
        "config": dataclasses.asdict(cfg)
        | {"source": str(cfg.source), "out": str(cfg.out), "work_dir": str(cfg.work_dir)},
        "finetune": {"minutes": round((t1 - t0) / 60, 1), "history": tune},
        "indexer": {"minutes": round((t2 - t1) / 60, 1), "history": index},
        "agreement": agreement_report(cfg.out, streams["eval"], cfg.eval_prompts),
    }
    (cfg.out / "dsa_training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_card(cfg.out, report)
    return report
