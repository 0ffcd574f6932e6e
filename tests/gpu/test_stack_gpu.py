"""The engine and the served stack on CUDA: the same device-generic code the CPU tests run,
placed on GPUs (`make test-gpu`; every test skips with its reason where CUDA is missing)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch

from tests.cli import generate_ids
from tests.stack import MODEL_NAME, start_stack
from tests.tiny import save_tiny_chat_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"
PROMPT = "def fibonacci(n):"


def _generate(device: str, *args: str, dtype: str = "float32") -> list[int]:
    env = {"TPLA_DEVICE": device, "TPLA_DTYPE": dtype}
    args = ("--model", str(DEMO), "--prompt", PROMPT, "--max-tokens", "16", *args)
    return generate_ids("--ignore-eos", *args, env=env, timeout=600)


@pytest.mark.parametrize(
    "layout",
    [
        (),
        ("--tp", "1", "--latent-groups", "1"),
        ("--tp", "2", "--latent-groups", "2"),
        ("--tp", "2", "--latent-groups", "1"),
        ("--tp", "2", "--parallel", "sp", "--chunk-size", "4"),
    ],
    ids=["one-process", "tp1", "tpla", "mla-tp", "sp"],
)
def test_generate_on_cuda_in_fp32_gives_the_cpu_greedy_tokens(layout: tuple[str, ...]) -> None:
    """fp32 on the GPU (the Triton backend, NCCL activations) gives the CPU's greedy tokens."""
    tp = int(layout[layout.index("--tp") + 1]) if "--tp" in layout else 1
    if tp > torch.cuda.device_count():
        pytest.skip(f"needs {tp} GPUs")
    assert _generate("cuda", *layout) == _generate("cpu", *layout)


def test_generate_on_cuda_in_bf16_runs() -> None:
    tokens = _generate("cuda", "--tp", "1", "--latent-groups", "1", dtype="bfloat16")
    assert len(tokens) == 16


@pytest.mark.parametrize("transport", ["grpc", "torch"])
def test_the_served_stack_on_one_gpu(tmp_path: Path, transport: str) -> None:
    """Prefill and a tp = 1 decode group on GPU 0, through the official client; every KV
    block free afterwards."""
    model = save_tiny_chat_model(tmp_path / "model", std=0.08)
    stack = start_stack(model, transport, DEVICE="cuda", DTYPE="float32", TP="1", LATENT_GROUPS="1")
    try:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "hello world, the quick brown fox"}]
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0
        )
        assert reply.usage.completion_tokens > 0
        streamed = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0, stream=True
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
        assert text == reply.choices[0].message.content
    finally:
        stack.stop()
