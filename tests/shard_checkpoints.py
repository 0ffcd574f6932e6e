"""Small multi-shard checkpoints written on the fly: plain, FP8 (DeepSeek-V3's block format)
and the same FP8 weights dequantized beforehand, with a random side file; and an in-process
group (threads) to run a real multi-rank decode step or prefill without processes."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import save_file
from torch import Tensor

from common.group.comm import Collectives, Comm, ReduceOp
from common.loading.side_file import LayerReparameterization, Method, Reparameterization
from common.model.args import ModelConfig
from common.model.causal_lm import DeepseekForCausalLM
from common.model.mtp import MTPLayer

T = TypeVar("T")

# Widths around FP8's 128 x 128 blocks: rank slices start mid-block (q_b rows of a head
# group, MLP rows at tp = 4, latent columns of a TPLA slice) and the last blocks are partial.
CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "vocab_size": 300,
    "hidden_size": 192,
    "intermediate_size": 320,
    "moe_intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "q_lora_rank": 160,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 24,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
BLOCK = 128
MTP_CONFIG: dict[str, Any] = {"num_nextn_predict_layers": 1}
FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}


def random_state(seed: int = 0) -> dict[str, Tensor]:
    """Random weights in the hub layout (one tensor per expert projection)."""
    with torch.device("meta"):
        model = DeepseekForCausalLM(ModelConfig.from_hf_dict(CONFIG))
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Tensor] = {}
    for name, p in model.state_dict().items():
        if "norm" in name:
            state[name] = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            state[name] = 0.05 * torch.randn(p.shape, generator=gen)
    per_expert(state)
    return state


def per_expert(state: dict[str, Tensor]) -> None:
    """Unstack fused `experts.gate_up_proj` / `down_proj` into the hub's per-expert
    gate / up / down weights, in place."""
    for name in [k for k in state if k.endswith("experts.gate_up_proj")]:
        prefix = name.removesuffix(".gate_up_proj")
        gate, up = state.pop(name).chunk(2, dim=1)
        down = state.pop(f"{prefix}.down_proj")
        for e in range(gate.shape[0]):
            state[f"{prefix}.{e}.gate_proj.weight"] = gate[e].clone()
            state[f"{prefix}.{e}.up_proj.weight"] = up[e].clone()
            state[f"{prefix}.{e}.down_proj.weight"] = down[e].clone()


def mtp_state(main: dict[str, Tensor], shared: str) -> dict[str, Tensor]:
    """Random MTP-layer tensors in the hub layout; its embedding and head: `equal` to the
    main model's (as V3 stores them), `absent`, or `different`."""
    config = ModelConfig.from_hf_dict({**CONFIG, **MTP_CONFIG})
    index = CONFIG["num_hidden_layers"]
    with torch.device("meta"):
        layer = MTPLayer(config, index)
    gen = torch.Generator().manual_seed(7)
    state = {}
    for name, p in layer.state_dict().items():
        scale = (1.0, 0.1) if "norm" in name else (0.0, 0.05)
        state[f"model.layers.{index}.{name}"] = scale[0] + scale[1] * torch.randn(
            p.shape, generator=gen
        )
    per_expert(state)
    embed, head = (
        f"model.layers.{index}.embed_tokens.weight",
        f"model.layers.{index}.shared_head.head.weight",
    )
    if shared == "equal":
        state[embed] = main["model.embed_tokens.weight"].clone()
        state[head] = main["lm_head.weight"].clone()
    elif shared == "absent":
        del state[embed], state[head]
    return state


def is_quantized(name: str, t: Tensor) -> bool:
    """DeepSeek-V3 stores every linear weight in FP8 except the router and the embeddings."""
    return (
        t.ndim == 2
        and "norm" not in name
        and "embed" not in name
        and "lm_head" not in name
        and "shared_head.head" not in name  # an MTP layer's copy of lm_head, bf16 as it
        and (not name.endswith("mlp.gate.weight"))
    )


def quantize(
    state: dict[str, Tensor], block: int = BLOCK
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(FP8 checkpoint with `_scale_inv` tensors of `block` x `block` blocks, the same weights
    dequantized in float32)."""
    fp8: dict[str, Tensor] = {}
    dequantized: dict[str, Tensor] = {}
    for name, w in state.items():
        if not is_quantized(name, w):
            fp8[name] = dequantized[name] = w
            continue
        rows, cols = w.shape
        br, bc = math.ceil(rows / block), math.ceil(cols / block)
        padded = torch.zeros(br * block, bc * block)
        padded[:rows, :cols] = w
        amax = padded.view(br, block, bc, block).abs().amax(dim=(1, 3))
        scale = (amax / 448.0).clamp(min=1e-12)
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
        q = (w / full).to(torch.float8_e4m3fn)
        fp8[name], fp8[f"{name}_scale_inv"] = q, scale
        dequantized[name] = q.float() * full
    return fp8, dequantized


def save_checkpoint(state: dict[str, Tensor], path: Path, files: int = 3, **config: Any) -> Path:
    """`state` split over `files` shards with an index (one file: model.safetensors)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**CONFIG, **config}))
    names = sorted(state)
    if files == 1:
        save_file({k: state[k].contiguous() for k in names}, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for i in range(files):
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        # Interleaved, so a weight and its scale usually land in different files.
        part = names[i::files]
        save_file({k: state[k].contiguous() for k in part}, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


class ThreadGroup:
    """The shared state of an in-process group whose ranks are threads."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list[Tensor | None] = [None] * world


class ThreadCollectives(Collectives):
    """Collectives between threads of one process: every rank reduces in rank order."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank = group, rank

    def all_gather(self, t: Tensor) -> Tensor:
        g = self.group
        g.slots[self.rank] = t.clone()
        g.barrier.wait()
        out = torch.stack([s for s in g.slots if s is not None])
        g.barrier.wait()
        return out

    def all_reduce_(self, t: Tensor, op: ReduceOp) -> None:
        parts = self.all_gather(t)
        t.copy_(parts.sum(0) if op is ReduceOp.SUM else parts.amax(0))

    def broadcast_(self, t: Tensor, src: int) -> None:
        t.copy_(self.all_gather(t)[src])

    def gather(self, t: Tensor, dst: int) -> Tensor | None:
        out = self.all_gather(t)
        return out if self.rank == dst else None

    def send(self, t: Tensor, dst: int) -> None:
        raise NotImplementedError("a decode step sends nothing point to point")

    def recv(self, t: Tensor, src: int) -> None:
        raise NotImplementedError("a decode step receives nothing point to point")

    def barrier(self) -> None:
        self.group.barrier.wait()


def run_group(world: int, body: Callable[[int, Comm], T]) -> list[T]:
    """`body(rank, comm)` for every rank of a group of `world` threads (a `Comm(1)` alone at
    world 1); the ranks' results in rank order. A rank that fails fails the call."""
    group = ThreadGroup(world)
    out: dict[int, T] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        coll = ThreadCollectives(group, rank) if world > 1 else None
        try:
            out[rank] = body(rank, Comm(world, coll, coll))
        except BaseException as exc:
            errors.append(exc)
            group.barrier.abort()  # the other ranks stop waiting for this one

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    assert len(out) == world, "a rank did not finish"
    return [out[rank] for rank in range(world)]


def fp8_copy(model_dir: Path, out: Path, block: int) -> tuple[Path, Path]:
    """`model_dir`'s weights as an FP8 checkpoint of `block` x `block` blocks (experts in the
    hub layout, so every expert projection is quantized), and the same weights dequantized
    beforehand: (fp8 dir, dequantized dir)."""
    from safetensors.torch import load_file

    state: dict[str, Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(file)))
    per_expert(state)
    fp8, dequantized = quantize({k: v.float() for k, v in state.items()}, block)
    config = json.loads((model_dir / "config.json").read_text())
    dirs = []
    for name, weights, extra in (
        ("fp8", fp8, {"quantization_config": {**FP8_CONFIG, "weight_block_size": [block] * 2}}),
        ("dequantized", dequantized, {}),
    ):
        path = out / name
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({**config, **extra}))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
        dirs.append(path)
    return dirs[0], dirs[1]


def random_rotation(fingerprint: str, seed: int = 1) -> Reparameterization:
    """A side file for `CONFIG`'s model (its `model_fingerprint`): a random orthogonal rotation
    and positive scales per layer (gamma folded and R applied on load)."""
    d_c, gen = CONFIG["kv_lora_rank"], torch.Generator().manual_seed(seed)
    layers = tuple(
        LayerReparameterization(
            torch.linalg.qr(torch.randn(d_c, d_c, generator=gen, dtype=torch.float64))[0],
            torch.rand(d_c, generator=gen, dtype=torch.float64) + 0.1,
        )
        for _ in range(CONFIG["num_hidden_layers"])
    )
    return Reparameterization(Method.PCA, 0, d_c, layers, False, fingerprint, 100, "random")
