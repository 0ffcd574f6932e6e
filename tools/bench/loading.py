"""`tpla bench loading`: peak resident memory of a process that loads a model, per rank.

Writes a random multi-shard checkpoint (a wide config, few layers, per-expert hub layout, at
least 2 GB by default) into a temporary directory, then loads it in fresh child processes and
reports each child's peak RSS (VmHWM, `peak_rss_bytes`) next to the bytes of parameters it keeps:

- `overhead`: imports everything a rank imports and reads the config, loads no weights;
- `whole`: the whole model (`load_model`, what the prefill worker holds);
- `rank`: one rank of tp = 2 TPLA (r = 2) and of tp = 2 MLA-TP, read shard-wise;
- `whole-then-slice`: the old way, the whole model loaded and then a rank's share kept;
- `rank-fp8`: one rank of tp = 2 TPLA read from the same model as a block-FP8 checkpoint
  (128 x 128 blocks), its linear weights kept FP8 (TPLA_WEIGHT_DTYPE=float8), the rest bf16;
- `prefill-rank`: both ranks of a tp = 2 prefill group (two processes over gloo), each
  reading its share shard-wise, then prefilling a 2,048-token prompt together in the
  device's default chunks (as a group's worker does): the peak covers loading and the
  prefill's activations;
- `decode-fp8-steps`: the follower of a tp = 2 decode group serving a V3-shaped FP8
  checkpoint kept FP8 in fp32 compute, after loading and after two requests
  (tools/bench/follower_memory.py): the peak covers the steps' buffers.

`--parts` runs some of the three checkpoints' rows: `plain` (the wide config in `--dtype`:
every row through prefill-rank), `fp8` (rank-fp8) and `fp8-steps`.

A rank read shard-wise should peak near overhead + its share. The checkpoint is deleted at
the end.

`tpla bench calibration` (tools/bench/calibration.py) measures `tpla convert`'s calibration
on the same kind of checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common.parallel import BASELINE, ParallelMode
from tools.bench.follower_memory import FP8_STEPS_CONFIG, STEPS_DTYPE, run_steps
from tools.bench.output import table_stream, write_result
from tools.bench.proc_memory import peak_rss_bytes

GIB = 2**30
PARTS = ("plain", "fp8", "fp8-steps")
# ~2.8 GB in float32: a 4096-wide model with a dense layer and a MoE layer, 32k vocabulary.
WIDE_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "vocab_size": 32768,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def write_checkpoint(
    out: Path,
    shard_bytes: int,
    dtype: str,
    layers: int,
    config: dict[str, Any] | None = None,
    fp8_block: int | None = None,
) -> int:
    """A random checkpoint of `config` (WIDE_CONFIG) in `out`, split into shards of
    ~`shard_bytes`; only one shard's tensors are in memory at a time. With `fp8_block`, the
    linear weights are block FP8 (DeepSeek-V3's format) and the rest `dtype`. Returns the
    bytes written."""
    import torch
    from safetensors.torch import save_file

    from common.model.args import ModelConfig
    from common.model.causal_lm import DeepseekForCausalLM

    config = {**(config or WIDE_CONFIG), "num_hidden_layers": layers, "torch_dtype": dtype}
    if fp8_block:
        block = [fp8_block, fp8_block]
        config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": block}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        meta = DeepseekForCausalLM(ModelConfig.from_hf_dict(config))
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for name, p in meta.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            prefix, (e, two_i, d) = name.removesuffix(".gate_up_proj"), p.shape
            for i in range(e):
                shapes.append((f"{prefix}.{i}.gate_proj.weight", (two_i // 2, d)))
                shapes.append((f"{prefix}.{i}.up_proj.weight", (two_i // 2, d)))
        elif name.endswith("experts.down_proj"):
            prefix, (e, d, inter) = name.removesuffix(".down_proj"), p.shape
            shapes += [(f"{prefix}.{i}.down_proj.weight", (d, inter)) for i in range(e)]
        else:
            shapes.append((name, tuple(p.shape)))
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    files: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = torch.Size(shape).numel() * torch_dtype.itemsize
        if files[-1] and size + nbytes > shard_bytes:
            files.append([])
            size = 0
        files[-1].append((name, shape))
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for k, entries in enumerate(files):
        file = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        tensors = {
            name: (
                1.0 + 0.1 * torch.randn(shape, generator=gen)
                if "norm" in name
                else 0.02 * torch.randn(shape, generator=gen)
            ).to(torch_dtype)
            for name, shape in entries
        }
        if fp8_block:
            for name, shape in entries:
                if _quantized(name, shape):
                    scale = [-(-n // fp8_block) for n in shape]
                    tensors[name] = (tensors[name].float() * 100).to(torch.float8_e4m3fn)
                    tensors[f"{name}_scale_inv"] = torch.full(scale, 0.01)
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        total += (out / file).stat().st_size
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total


def _quantized(name: str, shape: tuple[int, ...]) -> bool:
    """A linear weight DeepSeek-V3's FP8 checkpoints store in FP8 (not the router, the
    embedding or lm_head)."""
    skip = ("norm", "embed", "lm_head", "mlp.gate.weight")
    return len(shape) == 2 and not any(s in name for s in skip)


# -- the child: one load, one measurement -------------------------------------------------------


PREFILL_TOKENS = 2048


def prefill_child(model_dir: str, dtype: str, rank: int, port: int) -> dict[str, Any]:
    """Rank `rank` of a tp = 2 prefill group: its share, then one prompt's prefill."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from common.group.comm import Comm, DistCollectives
    from common.loading.serving_model import open_serving_weights
    from common.model.chunked import prefill_in_chunks
    from common.model.prefill_attention import make_prefill_attention, select_prefill_attention
    from common.parallel import ParallelConfig
    from services.prefill.batch.progress import default_chunk_tokens
    from services.prefill.rank.prefill_rank_model import PrefillRankModel

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(minutes=10),
    )
    data = DistCollectives()
    start = time.perf_counter()
    source = open_serving_weights(model_dir, None, dtype)[0]
    parallel = ParallelConfig(tp=2)
    model = PrefillRankModel(source, parallel, rank, Comm(2, data, data))
    del source
    # The kernel a served rank runs (`load_prefill_rank`): on the CPU the native one, which
    # streams over keys; SDPA over a packed batch would hold every head's scores.
    choice = select_prefill_attention("auto", model.device, model.lm_head.dtype)
    model.prefill_attention = make_prefill_attention(choice.kernel)
    seconds = time.perf_counter() - start
    loaded = peak_rss_bytes()
    gen = torch.Generator().manual_seed(0)  # both ranks prefill the same prompt
    ids = torch.randint(2, model.config.vocab_size, (PREFILL_TOKENS,), generator=gen)
    t0 = time.perf_counter()
    # In the CPU default's chunks, as the group's worker runs a prompt this long.
    chunk = default_chunk_tokens(model.device)
    prefill_in_chunks(model.prefill, ids, chunk)
    prefill_s = time.perf_counter() - t0
    dist.barrier()
    dist.destroy_process_group()
    return {
        "mode": "prefill-rank",
        "layout": parallel.name,
        "rank": rank,
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_after_load_bytes": loaded,
        "parameter_bytes": model.parameter_bytes(),
        "load_seconds": round(seconds, 2),
        "prefill_tokens": PREFILL_TOKENS,
        "prefill_chunk_tokens": chunk,
        "prefill_seconds": round(prefill_s, 2),
    }


def run_prefill_group(model_dir: Path, dtype: str) -> list[dict]:
    """Both ranks of a tp = 2 prefill group, as two child processes."""
    from common.runtime.ports import free_port

    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tools.bench.loading", "prefill-rank", str(model_dir), dtype]
    procs = [
        subprocess.Popen([*cmd, port, str(rank)], stdout=subprocess.PIPE, text=True, env=env)
        for rank in (0, 1)
    ]
    rows = []
    for proc in procs:
        out, _ = proc.communicate(timeout=3600)
        if proc.returncode:
            raise RuntimeError(f"prefill rank failed ({proc.returncode})")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return rows


def child(mode: str, model_dir: str, dtype: str, layout: str, rank: int) -> dict[str, Any]:
    """Load as `mode` says and report peak RSS and the parameter bytes kept (in this process)."""
    import torch

    from common.loading.loader import load_model
    from common.loading.serving_model import open_serving_weights
    from common.parallel import ParallelConfig
    from services.decode.rank.rank_model import RankModel

    torch.set_num_threads(1)
    start = time.perf_counter()
    kept = 0
    if mode == "overhead":
        open_serving_weights(model_dir, None, dtype)  # headers and config only
    elif mode == "whole":
        model = load_model(model_dir, dtype=dtype)
        kept = sum(p.numel() * p.element_size() for p in model.parameters())
    else:
        if mode == "rank":
            source: Any = open_serving_weights(model_dir, None, dtype)[0]
        elif mode == "rank-fp8":
            source = open_serving_weights(model_dir, None, dtype, "cpu", "float8")[0]
        else:  # whole-then-slice
            source = load_model(model_dir, dtype=dtype)
        parallel = ParallelConfig.parse(layout, tp=2, latent_groups=2)
        rank_model = RankModel(source, parallel, rank)
        del source
        kept = rank_model.parameter_bytes()
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes()
    return {
        "mode": mode,
        "layout": layout,
        "rank": rank,
        "peak_rss_bytes": peak,
        "parameter_bytes": kept,
        "load_seconds": round(seconds, 2),
    }


def run_child(model_dir: Path, dtype: str, mode: str, layout: str = "-", rank: int = 0) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "tools.bench.loading",
        mode,
        str(model_dir),
        dtype,
        layout,
        str(rank),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine() -> dict[str, Any]:
    import torch

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "memory_bytes": mem,
    }


def planned_rank_bytes(
    model_dir: Path,
    layout: str,
    rank: int,
    dtype: str,
    prefill: bool = False,
    model_dtype: str = "bfloat16",
) -> int:
    """What `tpla plan --weight-dtype dtype --dtype model_dtype` counts for this rank: a
    decode rank of `layout`, or a prefill rank."""
    from common.loading.checkpoint import Quantization
    from common.model.args import ModelConfig
    from common.parallel import ParallelConfig
    from common.tpla.rank_memory import prefill_rank_tensors, rank_tensors, weight_bytes

    c = ModelConfig.from_dir(model_dir)
    lay = ParallelConfig.parse(layout, tp=2, latent_groups=2)
    tensors = prefill_rank_tensors(c, lay, rank) if prefill else rank_tensors(c, lay, rank)
    return weight_bytes(tensors, dtype, Quantization.from_dir(model_dir).block, None, model_dtype)


def _plain_rows(tmp: Path, args: argparse.Namespace) -> list[dict]:
    rows = [run_child(tmp, args.dtype, "overhead"), run_child(tmp, args.dtype, "whole")]
    for layout in (ParallelMode.TPLA.value, BASELINE.value):
        rows += [run_child(tmp, args.dtype, "rank", layout, r) for r in (0, 1)]
    rows.append(run_child(tmp, args.dtype, "whole-then-slice", "tpla", 1))
    rows += run_prefill_group(tmp, args.dtype)
    for r in rows:
        if r["mode"] in ("rank", "whole-then-slice", "prefill-rank"):
            r["planned_bytes"] = planned_rank_bytes(
                tmp, r["layout"], r["rank"], args.dtype, prefill=r["mode"] == "prefill-rank"
            )
    return rows


def _run(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="tpla-loading-", dir=args.tmp_dir))
    out = table_stream(args.json)
    shard = int(args.shard_gb * GIB)
    rows: list[dict] = []
    checkpoints: dict[str, int] = {}
    try:
        if "plain" in args.parts:
            t0 = time.perf_counter()
            size = write_checkpoint(tmp, shard, args.dtype, args.layers)
            files = len(list(tmp.glob("*.safetensors")))
            took = time.perf_counter() - t0
            print(f"checkpoint: {size / GIB:.2f} GiB in {files} shards ({took:.0f} s)", file=out)
            checkpoints["plain"] = size
            rows += _plain_rows(tmp, args)
            shutil.rmtree(tmp, ignore_errors=True)
        if "fp8" in args.parts:
            # The same model as a block-FP8 checkpoint, a rank keeping it FP8 (the rest bf16).
            size = write_checkpoint(tmp, shard, "bfloat16", args.layers, fp8_block=128)
            checkpoints["fp8"] = size
            for rank in (0, 1):
                row = run_child(tmp, "bfloat16", "rank-fp8", "tpla", rank)
                row["planned_bytes"] = planned_rank_bytes(tmp, "tpla", rank, "float8")
                rows.append(row)
            shutil.rmtree(tmp, ignore_errors=True)
        if "fp8-steps" in args.parts:
            layers = FP8_STEPS_CONFIG["num_hidden_layers"]
            size = write_checkpoint(tmp, shard, "bfloat16", layers, FP8_STEPS_CONFIG, fp8_block=128)
            print(f"V3-shaped FP8 checkpoint: {size / GIB:.2f} GiB", file=out)
            checkpoints["fp8-steps"] = size
            row = run_steps(tmp)
            row["planned_bytes"] = planned_rank_bytes(
                tmp, "tpla", 1, "float8", model_dtype=STEPS_DTYPE
            )
            rows.append(row)
        overhead = rows[0]["peak_rss_bytes"] if rows[0]["mode"] == "overhead" else None
        for r in rows:
            if overhead is not None:
                r["peak_minus_overhead_bytes"] = r["peak_rss_bytes"] - overhead
            if "planned_bytes" in r:
                r["peak_minus_planned_bytes"] = r["peak_rss_bytes"] - r["planned_bytes"]
        result = {
            "checkpoint_bytes": checkpoints,
            "dtype": args.dtype,
            "config": {**WIDE_CONFIG, "num_hidden_layers": args.layers},
            "fp8_steps_config": FP8_STEPS_CONFIG,
            "machine": machine(),
            "rows": rows,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"{'mode':18} {'layout':7} {'rank':>4} {'peak RSS':>10} {'- plan':>9} "
        f"{'kept':>10} {'load s':>7}",
        file=out,
    )
    for r in rows:
        over = r.get("peak_minus_planned_bytes")
        print(
            f"{r['mode']:18} {r['layout']:7} {r['rank']:>4} {r['peak_rss_bytes'] / GIB:>8.2f} G "
            f"{'-' if over is None else f'{over / GIB:.2f} G':>9} "
            f"{r['parameter_bytes'] / GIB:>8.2f} G {r['load_seconds']:>7}",
            file=out,
        )
    return write_result(result, args)


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("loading", help="peak RSS of whole-model and shard-wise rank loads")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--layers", type=int, default=2, help="decoder layers (1 dense, rest MoE)")
    p.add_argument("--shard-gb", type=float, default=0.75, help="target size of a shard file")
    p.add_argument("--tmp-dir", default=None, help="where the checkpoint is written")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--json", action="store_true", help="last stdout line is the JSON result")
    p.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="which checkpoints' rows to run (default: all)",
    )
    p.set_defaults(func=_run)


if __name__ == "__main__":
    if sys.argv[1] == "prefill-rank":
        model_dir, dtype, port, rank = sys.argv[2:6]
        print(json.dumps(prefill_child(model_dir, dtype, int(rank), int(port))))
        from common.group.child import end_process

        end_process(0)  # right after its group's last collective: past the teardown's race
    else:
        mode, model_dir, dtype, layout, rank = sys.argv[1:6]
        print(json.dumps(child(mode, model_dir, dtype, layout, int(rank))))
