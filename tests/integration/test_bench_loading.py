"""`tpla bench loading`'s pieces on a small checkpoint: the generated shards load, and a
child process reports the rank's parameter bytes (equal to `tpla plan`'s) and its peak RSS;
a decode follower's peak after serving."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tools.bench.follower_memory import FP8_STEPS_CONFIG, MAX_TOKENS, run_steps
from tools.bench.loading import (
    WIDE_CONFIG,
    planned_rank_bytes,
    run_child,
    write_checkpoint,
)

SMALL = {
    **WIDE_CONFIG,
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_attention_heads": 4,
    "q_lora_rank": 96,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
}


def test_children_load_the_generated_shards_and_report_their_share(tmp_path: Path) -> None:
    size = write_checkpoint(tmp_path, 1 << 20, "float32", 2, SMALL)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3 and size > 3 << 20
    overhead = run_child(tmp_path, "float32", "overhead")
    rank = run_child(tmp_path, "float32", "rank", "tpla", 1)
    assert overhead["parameter_bytes"] == 0 and overhead["peak_rss_bytes"] > 50 << 20
    assert rank["parameter_bytes"] == planned_rank_bytes(tmp_path, "tpla", 1, "float32")
    assert rank["peak_rss_bytes"] > rank["parameter_bytes"]


def test_a_rank_keeping_an_fp8_checkpoint_fp8_holds_the_planned_float8_bytes(
    tmp_path: Path,
) -> None:
    write_checkpoint(tmp_path, 1 << 20, "bfloat16", 2, SMALL, fp8_block=16)
    rank = run_child(tmp_path, "bfloat16", "rank-fp8", "tpla", 1)
    assert rank["parameter_bytes"] == planned_rank_bytes(tmp_path, "tpla", 1, "float8")
    assert rank["parameter_bytes"] < planned_rank_bytes(tmp_path, "tpla", 1, "bfloat16")


def test_the_calibration_child_reports_its_peak_and_what_it_may_hold(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 1 << 20, "bfloat16", 2, SMALL)
    cmd = [sys.executable, "-m", "tools.bench.calibration", str(tmp_path), "2", "16"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["calibration_tokens"] == 32 and row["activation_bytes"] == 4 * 32 * 256
    assert row["peak_rss_bytes"] >= row["overhead_bytes"] > 50 << 20
    assert row["embedding_head_bytes"] == 4 * 2 * 512 * 256
    assert row["parameter_bytes"] < row["whole_model_bytes"]


def test_a_decode_follower_reports_its_peak_after_serving(tmp_path: Path) -> None:
    """The fp8-steps row on a small V3-shaped FP8 checkpoint: a tp = 2 group serves two
    requests and its follower's peak after them is at least its peak after loading."""
    config = {**FP8_STEPS_CONFIG, **SMALL}  # V3's routing and attention, small and 8 experts
    write_checkpoint(tmp_path, 1 << 20, "bfloat16", 2, config, fp8_block=16)
    row = run_steps(tmp_path)
    assert row["mode"] == "decode-fp8-steps" and row["rank"] == 1
    assert row["generated_tokens"] == [MAX_TOKENS, MAX_TOKENS]
    assert row["peak_rss_bytes"] >= row["peak_after_load_bytes"] > row["parameter_bytes"] > 0
    # fp32 compute keeps the bf16 norms, embedding and head in fp32: above the planned share.
    assert row["parameter_bytes"] > planned_rank_bytes(tmp_path, "tpla", 1, "float8")
