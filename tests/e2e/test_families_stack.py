"""Two families served end to end by `tpla serve` (real processes, the official openai client):
a tiny Kimi-K2.6-shaped checkpoint (the kimi_k25 wrapper, INT4 routed experts kept INT4 with
TPLA_WEIGHT_DTYPE=quantized, Kimi's tiktoken vocabulary and template shape) and a tiny
Mistral-Small-4-shaped one (the mistral3 wrapper, its query scaling by position, its router,
Mistral's special tokens). Each answers greedily exactly as the in-process engine driver
(`tpla generate --tp 2`, tools/local_driver.py) on the same chat prompt, with the weights
dequantized at load there: MLA-TP, an exact layout."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from common.text.chat_template import ChatMessage
from common.text.tokenizer import Tokenizer
from tests.cli import tpla_json
from tests.stack import MODEL_NAME, start_stack
from tests.tiny_families import (
    save_family,
    save_family_tokenizer,
    save_kimi_int4,
    save_kimi_tokenizer,
)

MESSAGES = [{"role": "user", "content": "hello world, the quick brown fox"}]
MAX_TOKENS = 6
KIMI_VOCAB = 524  # its tiny tiktoken vocabulary: 266 ranks and 258 specials


def _kimi(out: Path) -> Path:
    save_kimi_int4(out, vocab_size=KIMI_VOCAB, std=0.08)
    return save_kimi_tokenizer(out)


def _mistral(out: Path) -> Path:
    save_family("mistral4", out, vocab_size=416, std=0.08)
    return save_family_tokenizer(out, "mistral3")


@pytest.mark.parametrize("family", ["kimi-k2.6-int4", "mistral-small-4"])
def test_served_greedy_equals_the_local_driver(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    save = _kimi if family.startswith("kimi") else _mistral
    model = save(tmp_path_factory.mktemp(family))
    tok = Tokenizer.from_dir(model)
    ids = tok.encode_chat([ChatMessage(m["role"], m["content"]) for m in MESSAGES])
    reference = tpla_json(
        "generate", "--model", str(model), "--prompt-ids", ",".join(map(str, ids)),
        "--max-tokens", str(MAX_TOKENS), "--tp", "2", "--latent-groups", "1",
        "--method", "identity", "--ignore-eos", "--json", timeout=300,
    )  # fmt: skip
    stack = start_stack(model, "torch", LATENT_GROUPS="1", WEIGHT_DTYPE="quantized")
    try:
        client = openai.OpenAI(
            base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120
        )
        out = client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=MAX_TOKENS,
            logprobs=True,
            extra_body={"ignore_eos": True},
        )
    finally:
        stack.stop()
    assert out.usage is not None and out.usage.prompt_tokens == len(ids)
    assert out.choices[0].message.content == reference["text"]
    assert out.usage.completion_tokens == len(reference["token_ids"]) == MAX_TOKENS
