"""What constrains a chat or completion request's output, from its OpenAI body: a structured
output (response_format, structured_outputs) or tools (tool_choice, and how the prompt shows
the tools and earlier calls). Every grammar is compiled here once, so a bad one is a 400
naming the problem before anything is routed.
"""

from __future__ import annotations

import json
from dataclasses import replace

from common.runtime.errors import InvalidRequest
from common.sampling.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarKind,
    GrammarSpec,
    JsonWhitespace,
)
from common.text.chat_template import ChatMessage
from common.text.tokenizer import Tokenizer
from services.router import tools
from services.router.chat_schemas import ChatCompletionRequest
from services.router.completion_schemas import CompletionRequest


def tool_calling(
    body: ChatCompletionRequest, markup: tools.CallMarkup = tools.CallMarkup.DEEPSEEK_V3
) -> tools.ToolCalling | None:
    """The request's tool settings (`markup`: the model's own call markup); None when no
    tool may be called."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    defs = tuple(
        tools.Tool(
            t.function.name,
            t.function.description or "",
            json.dumps(t.function.parameters or {"type": "object", "properties": {}}),
        )
        for t in body.tools
    )
    parallel = body.parallel_tool_calls is not False
    if choice is None or choice == "auto":
        return tools.ToolCalling(tools.ToolMode.AUTO, defs, parallel=parallel, markup=markup)
    if choice == "required":
        return tools.ToolCalling(tools.ToolMode.REQUIRED, defs, parallel=parallel, markup=markup)
    assert not isinstance(choice, str)
    if choice.function.name not in {t.name for t in defs}:
        raise InvalidRequest(
            f"tool_choice names function {choice.function.name!r}, which is not in tools",
            param="tool_choice",
        )
    return tools.ToolCalling(tools.ToolMode.NAMED, defs, choice.function.name, parallel, markup)


def tool_grammar(
    body: ChatCompletionRequest, calling: tools.ToolCalling | None, grammars: GrammarCompiler | None
) -> GrammarSpec | None:
    """The grammar a required or named tool_choice decodes under (compiled), or None."""
    spec = tools.grammar(calling) if calling else None
    if spec is None:
        return None
    compiled(spec, grammars, "tools")
    if output_grammar(body, grammars) is not None:
        raise InvalidRequest(
            "a required or named tool_choice cannot be combined with a structured output",
            param="tool_choice",
        )
    return spec


def chat_messages(
    body: ChatCompletionRequest, calling: tools.ToolCalling | None, tokenizer: Tokenizer
) -> tuple[list[ChatMessage], list[dict[str, object]] | None]:
    """The conversation as the chat template reads it, and the tool definitions it renders
    itself (None: it renders none, and a system prompt describes the tools instead). A
    template without tool turns sees earlier calls as JSON and tool results as user turns."""
    native_turns = tokenizer.template_renders_tool_turns
    messages = []
    for m in body.messages:
        calls = tuple((c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ())
        if native_turns:
            messages.append(ChatMessage(m.template_role, m.text, calls, m.tool_call_id, m.thought))
        elif m.role == "tool":
            messages.append(ChatMessage("user", f"Tool result ({m.tool_call_id}): {m.text}"))
        elif calls:
            try:
                content = tools.calls_json([(n, a) for _, n, a in calls])
            except json.JSONDecodeError as exc:
                raise InvalidRequest(
                    f"an earlier tool call's arguments are not valid JSON: {exc}",
                    param="messages",
                ) from exc
            messages.append(ChatMessage("assistant", f"{m.text}\n{content}".lstrip()))
        else:
            messages.append(ChatMessage(m.template_role, m.text, reasoning_content=m.thought))
    if calling is None:
        return messages, None
    if tokenizer.template_renders_tools:
        return messages, [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.schema},
            }
            for t in calling.tools
        ]
    prompt = tools.system_prompt(calling.tools)
    if messages and messages[0].role == "system":
        messages[0] = replace(messages[0], content=f"{messages[0].content}\n\n{prompt}")
    else:
        messages.insert(0, ChatMessage("system", prompt))
    return messages, None


def output_grammar(
    body: ChatCompletionRequest | CompletionRequest,
    grammars: GrammarCompiler | None,
    whitespace: JsonWhitespace = JsonWhitespace.COMPACT,
) -> GrammarSpec | None:
    """The request's structured output (response_format or structured_outputs), compiled
    once here so a bad one is a 400 naming the problem; None when the output is free.
    `whitespace`: what a JSON output allows between its tokens."""
    spec, param = None, "structured_outputs"
    so = body.structured_outputs
    fmt = body.response_format
    if so is not None and fmt is not None and fmt.type != "text":
        raise InvalidRequest(
            "give either response_format or structured_outputs, not both", param=param
        )
    if fmt is not None and fmt.type == "json_object":
        spec, param = GrammarSpec.json_schema({"type": "object"}, whitespace), "response_format"
    elif fmt is not None and fmt.type == "json_schema":
        assert fmt.json_schema is not None
        spec = GrammarSpec.json_schema(fmt.json_schema.schema_, whitespace)
        param = "response_format"
    elif so is not None:
        if so.json_ is not None:
            schema = so.json_
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise InvalidRequest(
                        f"structured_outputs.json is not valid JSON: {exc}", param=param
                    ) from exc
            spec = GrammarSpec.json_schema(schema, whitespace)
        elif so.regex is not None:
            spec = GrammarSpec(GrammarKind.REGEX, so.regex)
        elif so.choice is not None:
            spec = GrammarSpec(GrammarKind.CHOICE, json.dumps(so.choice))
        else:
            assert so.grammar is not None
            spec = GrammarSpec(GrammarKind.GRAMMAR, so.grammar)
    return None if spec is None else compiled(spec, grammars, param)


def compiled(spec: GrammarSpec, grammars: GrammarCompiler | None, param: str) -> GrammarSpec:
    """`spec` once it compiles (cached for the workers' copies of the same spec)."""
    if grammars is None:
        raise InvalidRequest(
            "this model serves no structured outputs (no tokenizer.json)", param=param
        )
    try:
        grammars.compile(spec)
    except GrammarError as exc:
        raise InvalidRequest(str(exc)[:2000], param=param) from exc
    return spec
