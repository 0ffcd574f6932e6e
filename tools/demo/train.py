"""`tpla train-demo`: train a small DeepSeek-V2-architecture MLA model on CPU, offline.

Lifecycle: tokenizer (trained once, reused on resume) -> token streams (cached in the work
dir) -> training under a wall-clock budget with periodic held-out evaluation and checkpoints
-> an HF-format export (bf16 weights) with a model card measured on the exported weights.
"""

from __future__ import annotations

import gzip
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from common.model.args import ModelConfig
from common.model.causal_lm import DeepseekForCausalLM
from common.model.moe import MoE
from common.tpla import corpus
from tools.demo.chat_data import chat_documents
from tools.demo.model_card import model_card
from tools.demo.tokenizer_train import END, save_tokenizer, special_ids, train_tokenizer


@dataclass(frozen=True)
class DemoArch:
    """DeepSeek-like proportions: d_c = 4 d_n, one dense layer then MoE layers."""

    vocab_size: int = 6144
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    intermediate_size: int = 768
    moe_intermediate_size: int = 256
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    experts_per_token: int = 2
    max_position_embeddings: int = 4096

    @classmethod
    def tiny(cls, **overrides: int) -> DemoArch:
        """Same family and proportions at minimal size: trainer smoke tests."""
        fields = dict(
            vocab_size=512,
            hidden_size=64,
            num_layers=2,
            num_heads=2,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=4,
        )
        return cls(**{**fields, **overrides})

    def hf_config(self, bos: int, eos: int) -> dict[str, Any]:
        return {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_heads,
            "q_lora_rank": None,
            "kv_lora_rank": 4 * self.qk_nope_head_dim,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.experts_per_token,
            "topk_method": "greedy",
            "scoring_func": "softmax",
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": 10000.0,
            "rope_scaling": None,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "torch_dtype": "bfloat16",
        }


@dataclass(frozen=True)
class TrainConfig:
    out: Path
    work_dir: Path
    corpus_root: Path | None = None
    minutes: float = 40.0
    max_steps: int | None = None
    seq_len: int = 1024
    batch_size: int = 4
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.1
    balance_loss_weight: float = 0.01
    eval_every: int = 50
    eval_windows: int = 6
    checkpoint_minutes: float = 5.0
    card_eval_chars: int = 200_000
    seed: int = 0
    # CPU seconds spent before CPU time was recorded in the checkpoint (older runs).
    prior_cpu_seconds: float = 0.0
    arch: DemoArch = field(default_factory=DemoArch)


def init_weights(model: DeepseekForCausalLM, num_layers: int) -> None:
    """GPT-2 style init: N(0, 0.02), residual outputs scaled by 1/sqrt(2 L)."""
    for name, p in model.named_parameters():
        if p.dim() == 1:
            torch.nn.init.ones_(p) if "norm" in name else torch.nn.init.zeros_(p)
        elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            torch.nn.init.normal_(p, std=0.02 / math.sqrt(2 * num_layers))
        else:
            torch.nn.init.normal_(p, std=0.02)


class BalanceLoss:
    """Switch-style expert balance loss, collected by forward hooks on every MoE gate.

    Hooks keep the auxiliary loss out of the model file: the model stays inference math.
    """

    def __init__(self, model: DeepseekForCausalLM) -> None:
        self.terms: list[torch.Tensor] = []
        for module in model.modules():
            if isinstance(module, MoE):
                module.gate.register_forward_hook(self._hook)

    def _hook(self, gate: torch.nn.Module, inputs: tuple[torch.Tensor], out: Any) -> None:
        if not torch.is_grad_enabled():
            return
        x = inputs[0]
        probs = F.linear(x.float(), gate.weight.float()).softmax(-1)
        _, ids = out
        experts = probs.shape[-1]
        load = torch.bincount(ids.flatten(), minlength=experts).float() / ids.numel()
        self.terms.append(experts * (load * probs.mean(0)).sum())

    def pop(self) -> torch.Tensor:
        total = torch.stack(self.terms).mean() if self.terms else torch.zeros(())
        self.terms = []
        return total


def _encode_stream(tok: Any, docs: list[str], eos: int) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def prepare_data(cfg: TrainConfig) -> tuple[Any, dict[str, torch.Tensor]]:
    """Train (or reload) the tokenizer and tokenize the splits, cached in the work dir."""
    import tokenizers

    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    tok_path = cfg.work_dir / "tokenizer.json"
    train_docs = list(corpus.iter_documents(corpus.Split.TRAIN, cfg.corpus_root))
    if not train_docs:
        raise ValueError("the corpus has no training documents")
    if tok_path.is_file():
        tok = tokenizers.Tokenizer.from_file(str(tok_path))
    else:
        tok = train_tokenizer(train_docs, cfg.arch.vocab_size)
        tok.save(str(tok_path))
    cache = cfg.work_dir / "tokens.pt"
    if cache.is_file():
        return tok, torch.load(cache)
    eos = special_ids(tok)["<|eos|>"]
    chat = chat_documents(train_docs, bos="<|bos|>")
    eval_docs = list(corpus.iter_documents(corpus.Split.EVAL, cfg.corpus_root))
    streams = {
        "train": torch.cat([_encode_stream(tok, train_docs, eos), _encode_stream(tok, chat, eos)]),
        "eval": _encode_stream(tok, eval_docs or train_docs[:1], eos),
    }
    torch.save(streams, cache)
    return tok, streams


def _batch(stream: torch.Tensor, batch: int, seq: int, rng: random.Random) -> torch.Tensor:
    starts = [rng.randrange(0, len(stream) - seq - 1) for _ in range(batch)]
    return torch.stack([stream[s : s + seq + 1] for s in starts]).long()


def lm_loss(model: DeepseekForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of [B, T+1] windows."""
    b, t1 = windows.shape
    inputs = windows[:, :-1].reshape(-1)
    out = model(inputs, [t1 - 1] * b, all_logits=True)
    return F.cross_entropy(out.logits.float(), windows[:, 1:].reshape(-1))


def _lr(cfg: TrainConfig, step: int, progress: float) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _optimizer(model: DeepseekForCausalLM, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW, weight decay on the matrices but the embedding."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed" in n]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )


def _resume(
    state_path: Path, model: DeepseekForCausalLM, opt: torch.optim.AdamW, cfg: TrainConfig
) -> tuple[int, float, float, list[dict[str, Any]]]:
    """(step, elapsed s, CPU s, eval history) of the run saved at `state_path`, its model and
    optimizer state loaded; a fresh run's when there is none."""
    if not state_path.is_file():
        return 0, 0.0, 0.0, []
    state = torch.load(state_path, weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    print(f"resumed at step {state['step']} ({state['elapsed'] / 60:.1f} min trained)")
    cpu = state.get("cpu_seconds", cfg.prior_cpu_seconds)
    return state["step"], state["elapsed"], cpu, state["history"]


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train under the time budget (resuming from the work dir) and export `cfg.out`."""
    torch.manual_seed(cfg.seed)
    tok, streams = prepare_data(cfg)
    ids = special_ids(tok)
    hf_config = cfg.arch.hf_config(bos=ids["<|bos|>"], eos=ids["<|eos|>"])
    model = DeepseekForCausalLM(ModelConfig.from_hf_dict(hf_config))
    init_weights(model, cfg.arch.num_layers)
    balance = BalanceLoss(model)
    opt = _optimizer(model, cfg)
    state_path = cfg.work_dir / "train_state.pt"
    step, elapsed, cpu, history = _resume(state_path, model, opt, cfg)
    rng = random.Random(cfg.seed * 1_000_003 + step)
    eval_rng = random.Random(12345)
    eval_batch = _batch(streams["eval"], cfg.eval_windows, cfg.seq_len, eval_rng)
    budget = cfg.minutes * 60
    last_ckpt = time.monotonic()
    bar = tqdm(total=cfg.max_steps, initial=step, desc="train-demo", unit="step")

    def save_state() -> None:
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "step": step,
                "elapsed": elapsed,
                "history": history,
            },
            state_path,
        )

    model.train()
    while elapsed < budget and (cfg.max_steps is None or step < cfg.max_steps):
        t0, c0 = time.monotonic(), time.process_time()
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step, elapsed / budget)
        windows = _batch(streams["train"], cfg.batch_size, cfg.seq_len, rng)
        loss = lm_loss(model, windows)
        aux = balance.pop()
        opt.zero_grad(set_to_none=True)
        (loss + cfg.balance_loss_weight * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        elapsed += time.monotonic() - t0
        cpu += time.process_time() - c0
        bar.update(1)
        bar.set_postfix(
            loss=f"{loss.item():.3f}", aux=f"{aux.item():.3f}", min=f"{elapsed / 60:.1f}"
        )
        if step % cfg.eval_every == 0:
            with torch.no_grad():
                eval_loss = lm_loss(model, eval_batch).item()
            history.append(
                {
                    "step": step,
                    "minutes": round(elapsed / 60, 2),
                    "train_loss": round(loss.item(), 4),
                    "eval_loss": round(eval_loss, 4),
                }
            )
            tqdm.write(f"step {step}: train {loss.item():.3f} eval {eval_loss:.3f} nats/token")
        if time.monotonic() - last_ckpt > cfg.checkpoint_minutes * 60:
            save_state()
            last_ckpt = time.monotonic()
    bar.close()
    save_state()
    return export(cfg, model, tok, hf_config, streams, step, elapsed, history, cpu)


def _bits_per_byte_model(model: DeepseekForCausalLM, ids: torch.Tensor, seq: int) -> float:
    """Total cross-entropy (bits) of `ids` in non-overlapping windows of `seq` tokens."""
    total = 0.0
    model.eval()
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, seq):
            window = ids[start : start + seq + 1].long()
            if len(window) < 2:
                break
            out = model.prefill(window[:-1], [len(window) - 1], all_logits=True)
            total += F.cross_entropy(out.logits.float(), window[1:], reduction="sum").item()
    return total / math.log(2)


def measure(
    model: DeepseekForCausalLM, tok: Any, train_ids: torch.Tensor, text: str, seq: int
) -> dict[str, float]:
    """Held-out perplexity and bits per byte, beside unigram and gzip baselines."""
    ids = torch.tensor(tok.encode(text, add_special_tokens=False).ids, dtype=torch.long)
    if len(ids) < 2:
        raise ValueError("evaluation text is too short to measure")
    n_bytes = len(text.encode())
    model_bits = _bits_per_byte_model(model, ids, seq)
    predicted = len(ids) - 1
    counts = torch.bincount(train_ids.long(), minlength=model.config.vocab_size).double() + 1.0
    unigram_bits = -(counts / counts.sum()).log2()[ids].sum().item()
    return {
        "eval_tokens": float(len(ids)),
        "eval_bytes": float(n_bytes),
        "perplexity": math.exp(model_bits * math.log(2) / predicted),
        "bits_per_byte": model_bits / n_bytes,
        "unigram_bits_per_byte": unigram_bits / n_bytes,
        "gzip_bits_per_byte": 8 * len(gzip.compress(text.encode(), compresslevel=9)) / n_bytes,
    }


def save_hub_weights(model: torch.nn.Module, path: Path) -> None:
    """The model's weights as the hub stores DeepSeek checkpoints: bf16, routed experts one
    by one (`mlp.experts.{e}.gate_proj.weight`, ...)."""
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            for e, w in enumerate(tensor):
                gate, up = w.chunk(2)
                state[f"{prefix}.{e}.gate_proj.weight"] = gate
                state[f"{prefix}.{e}.up_proj.weight"] = up
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e, w in enumerate(tensor):
                state[f"{prefix}.{e}.down_proj.weight"] = w
        else:
            state[name] = tensor
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items()}
    save_file(state, str(path), metadata={"format": "pt"})


def export(
    cfg: TrainConfig,
    model: DeepseekForCausalLM,
    tok: Any,
    hf_config: dict[str, Any],
    streams: dict[str, torch.Tensor],
    steps: int,
    elapsed: float,
    history: list[dict[str, Any]],
    cpu_seconds: float = 0.0,
) -> dict[str, Any]:
    """Write HF-format files (bf16 weights, per-expert layout) and a measured model card."""
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    save_hub_weights(model, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    end = special_ids(tok)[END]
    gen_cfg = {
        "bos_token_id": hf_config["bos_token_id"],
        "eos_token_id": [hf_config["eos_token_id"], end],
        # Greedy, 64 tokens: what read best when measured (`tpla bench answers`, the card).
        "do_sample": False,
        "max_new_tokens": 64,
    }
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    save_tokenizer(tok, out, cfg.arch.max_position_embeddings)

    # Measure the exported (bf16-rounded) weights, exactly what users load.
    from common.loading.loader import load_model

    exported = load_model(out)
    text = corpus.eval_text(max_chars=cfg.card_eval_chars, root=cfg.corpus_root)
    eval_source = "eval split"
    if not text:  # a tiny custom corpus may hash no file into the eval split
        text = corpus.split_text(corpus.Split.TRAIN, cfg.corpus_root, cfg.card_eval_chars)
        eval_source = "train split (the corpus has no eval files; not a held-out measure)"
    metrics = measure(exported, tok, streams["train"], text, cfg.seq_len)
    params = sum(p.numel() for p in exported.parameters())
    report = {
        "steps": steps,
        "minutes": round(elapsed / 60, 1),
        "cpu_minutes": round(cpu_seconds / 60, 1),
        "parameters": params,
        "tokens_seen": steps * cfg.batch_size * cfg.seq_len,
        "metrics": metrics,
        "eval_source": eval_source,
        "history": history,
        "arch": asdict(cfg.arch),
        "train": {"seq_len": cfg.seq_len, "batch_size": cfg.batch_size, "lr": cfg.lr},
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "README.md").write_text(model_card(report))
    return report
