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


def deepseek_call(tok: Tokenizer, head: str, body: str) -> list[int]:
    """One call in DeepSeek-V3's markers, as the model writes its tokens: head<sep>body."""
    begin, end, call, call_end, sep = (tok.encode(m)[0] for m in DEEPSEEK_MARKERS)
    return [begin, call, *tok.encode(head), sep, *tok.encode(body), call_end, end]


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
    call = deepseek_call(tok, "function", 'get_weather\n```json\n{"city": "Rome"}\n```')
    ids = [*tok.encode("Sure."), *call, *tok.eos_token_ids]
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


# -- calls cut off by max_tokens, and calls streamed as they form -----------------------------

_CALLS = (
    '[{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}, '
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
    '{"name": "get_time", "parameters": {}}]'
)
_ARGUMENTS = '{"city": "Rome", "days": 3}'
_NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _calls(tool_calls: list[dict] | None) -> list[tuple[str, object]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls or []
    ]


def _assembled(events: list[dict], n: int) -> list[dict]:
    """Per choice: content, tool calls (checked to be in OpenAI's shape: id, type and name
    in a call's first delta only), how many deltas each call took, and the finish reason."""
    out = [{"content": "", "calls": {}, "deltas": {}, "reason": None} for _ in range(n)]
    for e in events:
        for c in e["choices"]:
            got, delta = out[c["index"]], c["delta"]
            got["content"] += delta.get("content") or ""
            got["reason"] = c["finish_reason"] or got["reason"]
            for d in delta.get("tool_calls") or []:
                first = d["index"] not in got["calls"]
                assert bool(d["id"]) == first and (d["type"] == "function") == first, d
                assert bool(d["function"]["name"]) == first, d
                call = got["calls"].setdefault(d["index"], {"name": d["function"]["name"]})
                call["arguments"] = call.get("arguments", "") + d["function"]["arguments"]
                got["deltas"][d["index"]] = got["deltas"].get(d["index"], 0) + 1
    return out


@pytest.mark.anyio
@pytest.mark.parametrize("choice", ["required", "auto", "named"])
@pytest.mark.parametrize("cut", [False, True], ids=["whole", "cut-off"])
async def test_tool_calls_survive_a_cut_off_and_stream_as_they_form(
    deepseek_dir: Path, redis_url: str, choice: str, cut: bool
) -> None:
    """n = 2, streamed and not. Whole: every call, finish_reason tool_calls. Cut off by
    max_tokens inside the second call: the first call only (not streamed), or the first
    and the second as far as it got (streamed), finish_reason length. Streamed, a call's
    arguments come in several fragments, and nothing of the list leaks into content."""
    tok = Tokenizer.from_dir(deepseek_dir)
    text = _ARGUMENTS if choice == "named" else _CALLS
    ids = [*tok.encode(text), *tok.eos_token_ids]
    if cut:  # the tokens up to the middle of "Oslo" (of "Rome" for the named function)
        at = text.index("Ro" if choice == "named" else "Os") + 2
        max_tokens = next(k for k in range(len(ids)) if len(tok.decode(ids[:k])) >= at)
        generated = tok.decode(ids[:max_tokens])
    else:
        max_tokens, generated = len(ids) + 4, text
    if choice == "named":
        expected = [] if cut else [("get_weather", {"city": "Rome", "days": 3})]
        streamed = [("get_weather", generated)]
    else:
        expected = [
            ("get_weather", {"city": "Rome", "days": 3}),
            ("get_weather", {"city": "Oslo"}),
            ("get_time", {}),
        ][: 1 if cut else 3]
        last = generated[generated.rindex('"parameters": ') + len('"parameters": ') :]
        streamed = [(n, json.dumps(a)) for n, a in expected]
        if cut:
            streamed.append(("get_weather", last))
    tool_choice = {"named": _NAMED}.get(choice, choice)
    reason = "length" if cut else "tool_calls"
    async with run_stack(deepseek_dir, redis_url, Script(ids)) as stack:
        body = chat(tools=TOOLS, tool_choice=tool_choice, max_tokens=max_tokens, n=2)
        resp = await stack.client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        for c in resp.json()["choices"]:
            assert c["finish_reason"] == reason, c
            assert c["message"]["content"] is None, c
            assert _calls(c["message"].get("tool_calls")) == expected, c
        resp = await stack.client.post("/v1/chat/completions", json={**body, "stream": True})
        events = [
            json.loads(line.removeprefix("data: "))
            for line in resp.text.splitlines()
            if line.startswith("data: {")
        ]
        for got in _assembled(events, 2):
            assert got["content"] == "" and got["reason"] == reason, got
            calls = [got["calls"][k] for k in sorted(got["calls"])]
            assert [c["name"] for c in calls] == [n for n, _ in streamed]
            for k, c in enumerate(calls):
                if k < len(expected) and choice != "named":
                    assert json.loads(c["arguments"]) == expected[k][1]
                else:  # as generated, as far as it got
                    assert c["arguments"] == streamed[k][1]
            assert got["deltas"][0] > 1  # the first call formed over several chunks
