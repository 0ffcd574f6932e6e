"""`tpla train-demo --mtp`: train one DeepSeek-V3 MTP layer on the frozen demo model, offline.

Lifecycle: load the exported demo model (frozen) and its tokenizer -> tokenize the train
split (capped) and the held-out eval text -> train the MTP layer under a wall-clock budget
(the main model's hidden states computed without autograd) -> export it in DeepSeek-V3's
layout beside the demo (`model.layers.{L}.*` in `model-mtp.safetensors`, a safetensors
index over both files, `num_nextn_predict_layers: 1`) and measure its acceptance.

As in the V3 report, the embedding and output head are the main model's and stay frozen;
the layer's copies of them are written too, because V3's checkpoints store them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from common.loading.loader import load_model
from common.model.causal_lm import DeepseekForCausalLM
from common.model.mtp import MTPLayer, mtp_prefill
from common.tpla import corpus
from tools.demo.mtp_acceptance import measure_acceptance, text_agreement
from tools.demo.train import BalanceLoss

MTP_FILE = "model-mtp.safetensors"
MAIN_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class MtpTrainConfig:
    model_dir: Path
    corpus_root: Path | None = None
    minutes: float = 20.0
    max_steps: int | None = None
    seq_len: int = 512
    batch_size: int = 4
    lr: float = 1e-3
    warmup_steps: int = 20
    balance_loss_weight: float = 0.01
    max_train_tokens: int = 4_000_000
    eval_chars: int = 200_000
    eval_windows: int = 32
    seed: int = 0


def _tokens(tok: Any, text_docs: list[str], cap: int) -> torch.Tensor:
    """The first `cap` tokens of the documents (encoding only about as many as needed:
    this tokenizer averages over 3 characters a token on Python)."""
    docs, chars = [], 0
    for doc in text_docs:
        if chars >= 4 * cap:
            break
        docs.append(doc)
        chars += len(doc)
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
    return torch.tensor(ids[:cap], dtype=torch.long)


def new_mtp_layer(model: DeepseekForCausalLM) -> MTPLayer:
    """An MTP layer for `model`: its decoder layer starts as a copy of the model's last one,
    the embedding and head are the model's own (shared, frozen), eh_proj random."""
    c = dataclasses.replace(model.config, num_nextn_predict_layers=1)
    layer = MTPLayer(c, c.num_hidden_layers)
    last = model.model.layers[-1].state_dict()
    missing = layer.load_state_dict(last, strict=False).missing_keys
    assert all(
        k.startswith(("embed_tokens", "enorm", "hnorm", "eh_proj", "shared")) for k in missing
    )
    torch.nn.init.normal_(layer.eh_proj.weight, std=0.02)
    layer.embed_tokens = model.model.embed_tokens
    layer.shared_head.head = model.lm_head
    layer.shared_head.norm.load_state_dict(model.model.norm.state_dict())
    return layer


def mtp_loss(model: DeepseekForCausalLM, layer: MTPLayer, windows: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the token after next over [B, T+2] windows (nats)."""
    b, t2 = windows.shape
    t = t2 - 2
    with torch.no_grad():
        main = model(windows[:, : t + 1].reshape(-1), [t + 1] * b)
        assert main.hidden is not None
        hidden = main.hidden.view(b, t + 1, -1)[:, :t].reshape(b * t, -1)
    out = mtp_prefill(
        layer, model.rope, windows[:, 1 : t + 1].reshape(-1), hidden, [t] * b, all_logits=True
    )
    return F.cross_entropy(out.logits.float(), windows[:, 2:].reshape(-1))


def train_mtp(cfg: MtpTrainConfig) -> dict[str, Any]:
    """Train under the time budget, export beside the demo and return the report."""
    import tokenizers

    torch.manual_seed(cfg.seed)
    model = load_model(cfg.model_dir)
    model.requires_grad_(False)
    tok = tokenizers.Tokenizer.from_file(str(cfg.model_dir / "tokenizer.json"))
    train_docs = list(corpus.iter_documents(corpus.Split.TRAIN, cfg.corpus_root))
    random.Random(cfg.seed).shuffle(train_docs)
    stream = _tokens(tok, train_docs, cfg.max_train_tokens)
    layer = new_mtp_layer(model)
    trainable = [p for n, p in layer.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    balance = BalanceLoss(layer)  # type: ignore[arg-type]
    rng = random.Random(cfg.seed + 1)
    step, elapsed, history = 0, 0.0, []
    budget = cfg.minutes * 60
    layer.train()
    while elapsed < budget and (cfg.max_steps is None or step < cfg.max_steps):
        t0 = time.monotonic()
        progress = min(elapsed / budget, 1.0)
        warm = min(1.0, (step + 1) / cfg.warmup_steps)
        lr = cfg.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = [rng.randrange(0, len(stream) - cfg.seq_len - 2) for _ in range(cfg.batch_size)]
        windows = torch.stack([stream[s : s + cfg.seq_len + 2] for s in starts])
        loss = mtp_loss(model, layer, windows)
        aux = balance.pop()
        opt.zero_grad(set_to_none=True)
        (loss + cfg.balance_loss_weight * aux).backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        step += 1
        elapsed += time.monotonic() - t0
        if step % 25 == 0:
            history.append(
                {"step": step, "minutes": round(elapsed / 60, 2), "loss": round(loss.item(), 4)}
            )
            print(f"step {step}: mtp loss {loss.item():.3f} ({elapsed / 60:.1f} min)", flush=True)
    if step % 25:
        history.append(
            {"step": step, "minutes": round(elapsed / 60, 2), "loss": round(loss.item(), 4)}
        )
    layer.eval()
    export_mtp(cfg.model_dir, layer)
    return report_mtp(cfg, tok, step, elapsed, history)


def export_mtp(model_dir: Path, layer: MTPLayer) -> None:
    """Write the layer as `model.layers.{L}.*` (bf16, per-expert hub layout) in its own file,
    the index over both files, and `num_nextn_predict_layers` in config.json."""
    index = layer_index(model_dir)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in layer.state_dict().items():
        key = f"model.layers.{index}.{name}"
        if name.endswith("experts.gate_up_proj"):
            prefix = key.removesuffix(".gate_up_proj")
            for e, w in enumerate(tensor):
                gate, up = w.chunk(2)
                state[f"{prefix}.{e}.gate_proj.weight"] = gate
                state[f"{prefix}.{e}.up_proj.weight"] = up
        elif name.endswith("experts.down_proj"):
            prefix = key.removesuffix(".down_proj")
            for e, w in enumerate(tensor):
                state[f"{prefix}.{e}.down_proj.weight"] = w
        else:
            state[key] = tensor
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items()}
    save_file(state, str(model_dir / MTP_FILE), metadata={"format": "pt"})
    with safe_open(str(model_dir / MAIN_FILE), framework="pt") as f:
        main_names = list(f.keys())
    weight_map = {name: MAIN_FILE for name in main_names} | {name: MTP_FILE for name in state}
    total = sum((model_dir / f).stat().st_size for f in (MAIN_FILE, MTP_FILE))
    doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (model_dir / INDEX_FILE).write_text(json.dumps(doc, indent=2) + "\n")
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["num_nextn_predict_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def layer_index(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["num_hidden_layers"])


def report_mtp(
    cfg: MtpTrainConfig, tok: Any, steps: int, elapsed: float, history: list[dict[str, Any]]
) -> dict[str, Any]:
    """Measure the exported (bf16) layer, loaded as users load it, and record it."""
    from common.loading.mtp_weights import load_mtp_layers

    model = load_model(cfg.model_dir)
    (layer,) = load_mtp_layers(cfg.model_dir, main=model)
    text = corpus.eval_text(max_chars=cfg.eval_chars, root=cfg.corpus_root)
    ids = torch.tensor(tok.encode(text, add_special_tokens=False).ids, dtype=torch.long)
    acc = measure_acceptance(model, layer, ids, windows=cfg.eval_windows)
    on_text = text_agreement(model, layer, ids, windows=cfg.eval_windows)
    report = {
        "layer": layer_index(cfg.model_dir),
        "steps": steps,
        "minutes": round(elapsed / 60, 1),
        "tokens_seen": steps * cfg.batch_size * cfg.seq_len,
        "train": {"seq_len": cfg.seq_len, "batch_size": cfg.batch_size, "lr": cfg.lr},
        "acceptance": {
            "rate": round(acc.rate, 4),
            "accepted": acc.accepted,
            "drafted": acc.drafted,
            "windows": acc.windows,
            "eval_chars": cfg.eval_chars,
            "agreement_on_text": round(on_text.rate, 4),
        },
        "history": history,
    }
    (cfg.model_dir / "mtp_training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_card_section(cfg.model_dir, report)
    return report


CARD_HEADING = "## MTP layer (DeepSeek-V3 multi-token prediction)"


def card_section(r: dict[str, Any]) -> str:
    a, t = r["acceptance"], r["train"]
    return f"""{CARD_HEADING}
One DeepSeek-V3 MTP module, trained by `tpla train-demo --mtp` on the frozen model above:
{r["steps"]} steps of {t["batch_size"]} x {t["seq_len"]} tokens, {r["minutes"]} minutes on
CPU, the embedding and head the main model's (frozen). Stored in V3's layout:
`num_nextn_predict_layers: 1` in config.json and its tensors as `model.layers.{r["layer"]}.*`
(enorm, hnorm, eh_proj, one MoE decoder layer, shared_head, and V3's copies of the embedding
and head) in `model-mtp.safetensors`, listed with the main weights in
`model.safetensors.index.json`. HF transformers ignores the layer; our loader reads it only
when asked, keeping one copy of the embedding and head.

Greedy-speculation acceptance on held-out text (`tpla bench mtp-acceptance --windows
{a["windows"]}`): {a["windows"]} evenly spaced 64-token prompts from the first
{a["eval_chars"]:,} characters of the eval split, each continued greedily for 64 tokens by
the main model. A draft (the MTP layer's greedy token for t+2, fed the main model's token
t+1) is accepted when it equals the main model's greedy token at t+2:
**{a["rate"]:.1%}** of positions ({a["accepted"]} / {a["drafted"]}). On the eval text itself
(the text's token t+1 fed), the draft equals the main model's greedy token at t+2 at
{a["agreement_on_text"]:.1%} of positions. The record is `mtp_training_report.json`.
"""


def write_card_section(model_dir: Path, report: dict[str, Any]) -> None:
    """Add (or replace) the model card's MTP section."""
    card = model_dir / "README.md"
    text = card.read_text() if card.is_file() else ""
    text = text.split(CARD_HEADING)[0].rstrip("\n")
    card.write_text((text + "\n\n" if text else "") + card_section(report))
