"""`tpla bench ttft`: long prompts end to end through the real stack, per prefill group size
and chunk size.

Per (prefill tp, chunk tokens, prompt length): time to first token as a client sees it
(streamed /v1/completions of token ids), prefill tokens/s (prompt tokens / the prefill
worker's compute seconds, from the request's record), the exposed KV transfer time (the
record's: from the end of the last chunk's compute to the decode group holding the whole
prompt) and, per prefill rank, the peak resident memory above that rank's baseline after
loading and a warm-up prompt. The peak is each process's VmHWM, reset before each prompt
length (`/proc/PID/clear_refs`), so a row is that length's own peak.

The demo model covers prompts up to its 4,096 positions. A run with a longer prompt uses a
synthetic random DeepSeek-V3-architecture model with YaRN scaling (`LONG_CONTEXT_CONFIG`)
for all its rows, so they stay comparable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from tools.bench.output import table_stream
from tools.bench.serve_stack import REQUEST_TIMEOUT_S, stream_completion

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"
SERVED = "bench"
# Small enough to prefill 16K tokens on a 2-core CPU in seconds, with the real V3 shape of
# attention (q_lora, decoupled RoPE, YaRN) and a MoE layer.
LONG_CONTEXT_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 6144,  # the demo's: the model serves with the demo's tokenizer
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 65536,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}
DEMO_POSITIONS = 4096


@dataclass(frozen=True)
class Row:
    prefill_tp: int
    chunk_tokens: int  # 0: unchunked
    prompt_tokens: int
    ttft_s: float  # median over the repeats
    prefill_s: float  # the prefill worker's compute, median
    prefill_tokens_per_s: float
    exposed_transfer_s: float | None  # None: the record carries no such field
    peak_above_baseline_bytes: list[int]  # per prefill rank, rank 0 first


def _status(pid: int, key: str) -> int:
    """A /proc/PID/status size in bytes (VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} for process {pid}")


def _reset_peak(pid: int) -> None:
    """VmHWM back to the current RSS (Linux's clear_refs "5")."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def prefill_ranks(workers: list[dict]) -> list[int]:
    """Each prefill worker's process, then the processes of its group's other ranks (its
    children: a one-host group spawns them), rank order as started."""
    import psutil

    pids: list[int] = []
    for w in workers:
        if w["role"] != "prefill":
            continue
        leader = psutil.Process(w["pid"])
        pids += [leader.pid, *(c.pid for c in leader.children(recursive=True))]
    return pids


@contextmanager
def _model(prompt_tokens: Sequence[int], max_tokens: int, model: str | None) -> Iterator[Path]:
    if model:
        yield Path(model)
        return
    if max(prompt_tokens) + max_tokens <= DEMO_POSITIONS:
        yield DEMO
        return
    from tools.bench.loading import write_checkpoint

    with tempfile.TemporaryDirectory(prefix="tpla-ttft-") as tmp:
        out = Path(tmp)
        write_checkpoint(out, 1 << 30, "float32", 2, LONG_CONTEXT_CONFIG)
        shutil.copy(DEMO / "tokenizer.json", out / "tokenizer.json")
        # The demo's tokenizer config caps the context at the demo's 4,096 positions.
        tok = json.loads((DEMO / "tokenizer_config.json").read_text())
        tok["model_max_length"] = LONG_CONTEXT_CONFIG["max_position_embeddings"]
        (out / "tokenizer_config.json").write_text(json.dumps(tok))
        yield out


def _record(url: str, request_id: str) -> dict[str, Any]:
    return httpx.get(f"{url}/admin/requests/{request_id}", timeout=10).json()


async def _one(url: str, prompt: list[int], max_tokens: int) -> tuple[float, dict[str, Any]]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as client:
        out = await stream_completion(client, url, SERVED, prompt, max_tokens)
    if out.timing.error:
        raise RuntimeError(out.timing.error)
    return out.timing.ttft_s, _record(url, out.request_id) if out.request_id else {}


def measure(
    url: str,
    ranks: list[int],
    vocab: int,
    lengths: Sequence[int],
    repeats: int,
    max_tokens: int,
    seed: int,
) -> list[tuple[int, float, float, float | None, list[int]]]:
    """(length, TTFT, prefill seconds, exposed transfer seconds, peak per rank) per length.
    Every prompt is new random tokens: no prefix cache hit."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(2, vocab) for _ in range(n)]

    asyncio.run(_one(url, prompt(64), max_tokens))  # warm-up: first-call allocations
    baseline = [_status(pid, "VmRSS") for pid in ranks]
    rows = []
    for length in sorted(lengths):
        for pid in ranks:
            _reset_peak(pid)
        ttfts, prefills, exposed = [], [], []
        for _ in range(repeats):
            ttft, record = asyncio.run(_one(url, prompt(length), max_tokens))
            ttfts.append(ttft)
            prefills.append(float(record.get("prefill_seconds", "nan")))
            if "exposed_transfer_seconds" in record:
                exposed.append(float(record["exposed_transfer_seconds"]))
        peaks = [_status(pid, "VmHWM") - base for pid, base in zip(ranks, baseline, strict=True)]
        rows.append(
            (
                length,
                statistics.median(ttfts),
                statistics.median(prefills),
                statistics.median(exposed) if exposed else None,
                peaks,
            )
        )
    return rows


def run(args: argparse.Namespace) -> list[Row]:
    from tools.local_stack import LocalStack

    out: list[Row] = []
    with _model(args.prompt_tokens, args.max_tokens, args.model) as model:
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        for tp in args.prefill_tp:
            for chunk in args.chunk_tokens:
                settings = {
                    "SERVED_MODEL_NAME": SERVED,
                    "PREFILL_TP": str(tp),
                    "PREFILL_CHUNK_TOKENS": str(chunk),
                    "TP": "2",
                    "LATENT_GROUPS": "2",
                    "REPARAM": "",
                    "PREFIX_CACHE": "0",
                    "LEASE_SECONDS": "600",
                    "QUEUE_TIMEOUT_S": "600",
                    "TOKEN_TIMEOUT_S": "600",
                }
                with LocalStack.start(model, **settings) as stack:
                    ranks = prefill_ranks(stack.workers())
                    for length, ttft, prefill_s, exposed, peaks in measure(
                        stack.url,
                        ranks,
                        vocab,
                        args.prompt_tokens,
                        args.repeats,
                        args.max_tokens,
                        args.seed,
                    ):
                        out.append(
                            Row(
                                tp,
                                chunk,
                                length,
                                ttft,
                                prefill_s,
                                length / prefill_s,
                                exposed,
                                peaks,
                            )
                        )
    return out


def format_rows(rows: list[Row]) -> str:
    lines = [
        f"{'prefill tp':>10} {'chunk':>6} {'prompt':>7} {'TTFT s':>8} {'prefill s':>9} "
        f"{'tok/s':>8} {'exposed s':>9}  peak MiB per rank"
    ]
    for r in rows:
        exposed = "-" if r.exposed_transfer_s is None else f"{r.exposed_transfer_s:.3f}"
        peaks = " ".join(f"{p / 2**20:.0f}" for p in r.peak_above_baseline_bytes)
        lines.append(
            f"{r.prefill_tp:>10} {r.chunk_tokens or 'whole':>6} {r.prompt_tokens:>7} "
            f"{r.ttft_s:>8.3f} {r.prefill_s:>9.3f} {r.prefill_tokens_per_s:>8.0f} "
            f"{exposed:>9}  {peaks}"
        )
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    t0 = time.time()
    rows = run(args)
    result = {
        "bench": "ttft",
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "seconds": round(time.time() - t0, 1),
        "rows": [asdict(r) for r in rows],
    }
    print(format_rows(rows), file=table_stream(args.json))
    if args.json:
        print(json.dumps(result))
    return 0


def add_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bsub.add_parser(
        "ttft",
        help="long prompts through the real stack: TTFT, prefill tokens/s, exposed transfer, "
        "peak memory per prefill rank",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prefill-tp", type=int, nargs="+", default=[1])
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--chunk-tokens", type=int, nargs="+", default=[1024], help="0: unchunked")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=2, help="tokens generated per request")
    p.add_argument(
        "--model",
        help="model directory (default: the demo, or the synthetic "
        "long-context model when a prompt is longer than the demo's positions)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="stdout: only the JSON result")
    p.set_defaults(func=_run)
