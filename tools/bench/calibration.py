"""`tpla bench calibration`: peak resident memory and time of `tpla convert`'s calibration,
which reads a checkpoint layer by layer (common/tpla/layer_calibration.py).

Writes a random checkpoint as `tpla bench loading` does (tools/bench/loading.py), then one
child reads it layer by layer, pushing random token windows through each, and reports its peak
RSS beside its footprint before the first layer (imports, headers) and the bytes of the
largest layer, the embedding and LM head and the activations, in float32. The checkpoint is
deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools.bench.loading import (
    GIB,
    WIDE_CONFIG,
    machine,
    write_checkpoint,
)
from tools.bench.output import table_stream, write_result
from tools.bench.proc_memory import peak_rss_bytes

# `--calibrate`: random windows pushed through each layer (8 x 512 tokens by default).
CALIBRATION_WINDOWS = 8
CALIBRATION_WINDOW = 512


def calibrate_child(model_dir: str, windows: int, window: int) -> dict[str, Any]:
    """The layer-by-layer calibration of the checkpoint: its peak RSS and time, its footprint
    before reading a layer, and the float32 bytes of what it may hold at once."""
    import torch

    from common.loading.weights import CheckpointWeights
    from common.model.causal_lm import DecoderLayer
    from common.tpla.layer_calibration import calibrate_checkpoint

    torch.set_num_threads(1)
    c = CheckpointWeights(model_dir, torch.float32).config  # config and headers only
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(2, c.vocab_size, (window,), generator=gen) for _ in range(windows)]
    overhead = peak_rss_bytes()
    start = time.perf_counter()
    calibration = calibrate_checkpoint(model_dir, ids, progress=False)
    seconds = time.perf_counter() - start
    layers = []
    for index in range(c.num_hidden_layers):
        with torch.device("meta"):
            layers.append(sum(p.numel() for p in DecoderLayer(c, index).state_dict().values()))
    return {
        "mode": "calibrate",
        "layout": "-",
        "rank": 0,
        "peak_rss_bytes": peak_rss_bytes(),
        "overhead_bytes": overhead,
        "parameter_bytes": 4 * max(layers),  # the largest layer
        "embedding_head_bytes": 4 * 2 * c.vocab_size * c.hidden_size,
        "activation_bytes": 4 * windows * window * c.hidden_size,
        "whole_model_bytes": 4 * (sum(layers) + 2 * c.vocab_size * c.hidden_size),
        "calibration_tokens": calibration.stats.tokens,
        "load_seconds": round(seconds, 2),
    }


def _run(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="tpla-calibration-", dir=args.tmp_dir))
    out = table_stream(args.json)
    try:
        size = write_checkpoint(tmp, int(args.shard_gb * GIB), args.dtype, args.layers)
        print(f"checkpoint: {size / GIB:.2f} GiB, {args.layers} layers", file=out)
        cmd = [sys.executable, "-m", "tools.bench.calibration", str(tmp)]
        cmd += [str(CALIBRATION_WINDOWS), str(CALIBRATION_WINDOW)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    row["peak_minus_overhead_bytes"] = row["peak_rss_bytes"] - row["overhead_bytes"]
    held = row["parameter_bytes"] + row["embedding_head_bytes"] + row["activation_bytes"]
    row["peak_over_held"] = round(row["peak_minus_overhead_bytes"] / held, 3)
    result = {
        "checkpoint_bytes": size,
        "dtype": args.dtype,
        "config": {**WIDE_CONFIG, "num_hidden_layers": args.layers},
        "machine": machine(),
        "rows": [row],
    }
    for key in (
        "peak_rss_bytes",
        "overhead_bytes",
        "peak_minus_overhead_bytes",
        "parameter_bytes",
        "embedding_head_bytes",
        "activation_bytes",
        "whole_model_bytes",
    ):
        print(f"{key:27} {row[key] / GIB:8.2f} GiB", file=out)
    print(
        f"peak - overhead over (largest layer + embedding, head + activations): "
        f"{row['peak_over_held']}; {row['load_seconds']} s",
        file=out,
    )
    return write_result(result, args)


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("calibration", help="peak RSS of tpla convert's layer-by-layer calibration")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--layers", type=int, default=8, help="decoder layers (1 dense, rest MoE)")
    p.add_argument("--shard-gb", type=float, default=0.75, help="target size of a shard file")
    p.add_argument("--tmp-dir", default=None, help="where the checkpoint is written")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--json", action="store_true", help="last stdout line is the JSON result")
    p.set_defaults(func=_run)


if __name__ == "__main__":
    model_dir, windows, window = sys.argv[1:4]
    print(json.dumps(calibrate_child(model_dir, int(windows), int(window))))
