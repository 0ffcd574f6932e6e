"""Tool calls the workers generate as DeepSeek-V3's special-token markers, through the router
on the rig (tests/router_rig.py): parsed under `auto`, answered as tool_calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.text.tokenizer import Tokenizer
from tests.router_rig import Script, chat, run_stack
from tests.tiny import CORPUS, train_tokenizer
from tests.unit.services.router.test_tools import TOOLS

DEEPSEEK_MARKERS = [
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
]
# Renders earlier calls with the markers, as DeepSeek-V3's template does (reads tool_calls).
DEEPSEEK_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<｜tool▁call▁begin｜>{{ c['function']['name'] }}"
    "{% endfor %}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("deepseek-like")
    backend = train_tokenizer(400, CORPUS)
    backend.add_special_tokens(DEEPSEEK_MARKERS)
    backend.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": DEEPSEEK_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    return path


@pytest.mark.anyio
async def test_deepseek_markers_from_the_model_become_tool_calls(
    deepseek_dir: Path, redis_url: str
) -> None:
    """The workers generate DeepSeek-V3's call markers (special tokens): the router keeps them
    in the text, parses them under `auto`, and answers with tool_calls, streamed or not."""
    tok = Tokenizer.from_dir(deepseek_dir)
    begin, end, call, call_end, sep = (tok.encode(m)[0] for m in DEEPSEEK_MARKERS)
    ids = [
        *tok.encode("Sure."),
        begin,
        call,
        *tok.encode("function"),
        sep,
        *tok.encode('get_weather\n```json\n{"city": "Rome"}\n```'),
        call_end,
        end,
        *tok.eos_token_ids,
    ]
    async with run_stack(deepseek_dir, redis_url, Script(ids)) as stack:
        body = chat(tools=TOOLS, max_tokens=len(ids) + 4)
        resp = await stack.client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Sure."
        [out] = choice["message"]["tool_calls"]
        assert out["function"]["name"] == "get_weather"
        assert json.loads(out["function"]["arguments"]) == {"city": "Rome"}
        resp = await stack.client.post("/v1/chat/completions", json={**body, "stream": True})
        events = [
            json.loads(line.removeprefix("data: "))
            for line in resp.text.splitlines()
            if line.startswith("data: {")
        ]
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        assert "".join(d.get("content") or "" for d in deltas) == "Sure."
        [streamed] = [c for d in deltas for c in d.get("tool_calls") or []]
        assert streamed["function"]["name"] == "get_weather"
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
