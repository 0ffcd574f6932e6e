"""DeepSeek-V3.2's prompt format: the model ships no Jinja chat template but a Python encoder;
this is the same format, written for this server (a chat request's messages -> prompt text).

    <bos>SYSTEM[\\n\\n## Tools ... <functions>TOOL SCHEMAS</functions>\\n]
    <｜User｜>TEXT<｜Assistant｜>  then <think> (thinking, the last user turn) or </think>
    assistant: [REASONING</think>]CONTENT[\\n\\n<｜DSML｜function_calls>...]<eos>
    tool results: \\n\\n<function_results>\\n<result>...</result>...\\n</function_results>
                  \\n\\n then <think> or </think>, as after a user turn

Thinking mode (`thinking` or `enable_thinking` true among the template variables) opens
`<think>` after the last user turn and after the tool results that follow it; an assistant
turn after the last user turn shows its reasoning, earlier ones do not (their reasoning is
dropped, and the turn that opened them closed it at once). Tool calls are DSML
(services/router/dsml.py reads them back):

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">TEXT</｜DSML｜parameter>   (strings as is)
    <｜DSML｜parameter name="KEY" string="false">JSON</｜DSML｜parameter>  (anything else)
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

Tools are described in the first message when it is a system (or developer) message, else
in a system message of their own put first. A developer message is a user turn that carries
the tools and the user's message. Every failure is a TokenizerError (bad input).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from common.runtime.errors import TokenizerError
from common.text.chat_template import ChatMessage, check_variables

USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
DSML = "｜DSML｜"
CALLS_BEGIN = f"<{DSML}function_calls>"
CALLS_END = f"</{DSML}function_calls>"
INVOKE_END = f"</{DSML}invoke>"

# The tool description the model was trained with, word for word.
_TOOLS = """## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{dsml}function_calls>" block like the following as part of your reply to the user:
<{dsml}function_calls>
<{dsml}invoke name="$FUNCTION_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$FUNCTION_NAME2">
...
</{dsml}invoke>
</{dsml}function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:

<{dsml}function_calls>
...
</{dsml}function_calls>

<function_results>
...
</function_results>

{think}...thinking about results{end_think}

Here are the functions available in JSONSchema format:
<functions>
{schemas}
</functions>
"""  # noqa: E501


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tools_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools' description (OpenAI tool objects: their `function`s, one JSON per line)."""
    schemas = "\n".join(_json(t["function"]) for t in tools)
    return _TOOLS.format(dsml=DSML, think=THINK, end_think=END_THINK, schemas=schemas)


def dsml_calls(calls: Sequence[tuple[str, str]]) -> str:
    """(name, arguments JSON) calls as a DSML function_calls block."""
    invokes = []
    for name, arguments in calls:
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            raise TokenizerError(f"tool call {name!r}: arguments are not JSON: {exc}") from exc
        if not isinstance(args, dict):
            raise TokenizerError(f"tool call {name!r}: arguments must be a JSON object")
        params = [
            f'<{DSML}parameter name="{key}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _json(v)}</{DSML}parameter>"
            for key, v in args.items()
        ]
        invokes.append(f'<{DSML}invoke name="{name}">\n' + "\n".join(params) + f"\n{INVOKE_END}")
    return f"{CALLS_BEGIN}\n" + "\n".join(invokes) + f"\n{CALLS_END}"


class DeepseekV32Encoding:
    """DeepSeek-V3.2's prompt format, in place of a chat template (common/text/tokenizer.py
    chooses it for a model whose config says `deepseek_v32` and that ships no template)."""

    available = True
    # What it reads of a request and writes, as ChatTemplate.reads answers for a template's
    # source.
    _READS = frozenset(
        {"tools", "tool_calls", "reasoning_content", "thinking", THINK, END_THINK, DSML}
    )

    def reads(self, variable: str) -> bool:
        return variable in self._READS

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        bos_token: str,
        eos_token: str,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text. Every turn that hands over to the model (a user turn, a turn's
        last tool result) already ends with the assistant's opening, so
        `add_generation_prompt` changes nothing."""
        check_variables(variables)
        variables = variables or {}
        thinking = bool(variables.get("thinking") or variables.get("enable_thinking"))
        msgs = list(messages)
        head: ChatMessage | None = None  # the message that describes the tools
        tool_text = ""
        if tools:
            if msgs and msgs[0].role in ("system", "developer"):
                head = msgs[0]
            else:
                head = ChatMessage("system", "")
                msgs.insert(0, head)
            tool_text = "\n\n" + tools_text(tools)
        users = [i for i, m in enumerate(msgs) if m.role in ("user", "developer")]
        last_user = users[-1] if users else -1
        out = [bos_token]
        for i, m in enumerate(msgs):
            opens = thinking and i >= last_user  # this hand-over opens the model's thinking
            described = tool_text if m is head else ""
            if m.role == "system":
                out.append(m.content + described)
            elif m.role in ("user", "developer"):
                text = m.content
                if m.role == "developer":
                    text = f"{described}\n\n# The user's message is: {m.content}"
                out.append(f"{USER}{text}{ASSISTANT}{THINK if opens else END_THINK}")
            elif m.role == "tool":
                out.append(_tool_result(msgs, i, THINK if opens else END_THINK))
            else:
                shown = thinking and i > last_user
                reasoning = f"{m.reasoning_content or ''}{END_THINK}" if shown else ""
                calls = ""
                if m.tool_calls:
                    calls = "\n\n" + dsml_calls([(n, a) for _, n, a in m.tool_calls])
                out.append(f"{reasoning}{m.content}{calls}{eos_token}")
        return "".join(out)


def _tool_result(msgs: Sequence[ChatMessage], i: int, handover: str) -> str:
    """Tool message i: one result in its assistant turn's block of results, which opens at
    the first and, after the last, hands over to the model."""
    turn = i - 1
    while turn >= 0 and msgs[turn].role == "tool":
        turn -= 1
    calls = len(msgs[turn].tool_calls) if turn >= 0 and msgs[turn].role == "assistant" else 0
    order = i - turn
    if order > calls:
        raise TokenizerError(f"message {i}: a tool result without its assistant tool call")
    text = "\n\n<function_results>" if order == 1 else ""
    text += f"\n<result>{msgs[i].content}</result>"
    if order == calls:
        text += f"\n</function_results>\n\n{handover}"
    return text
