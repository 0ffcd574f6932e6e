"""One streamed chat choice's text on its way out, with tools: content, or tool_calls deltas
in OpenAI's shape (a call's id, type and name in the first delta for its index, then its
arguments in fragments as they are generated).

Where the text goes (`_Stream`):
    named      ARGUMENTS from the first token: the function's arguments, streamed as they come
    required   CALLS: the JSON call list, read by tool_stream.CallListScanner as it grows
    auto       UNDECIDED (held back) while the text may still open a JSON call list; CALLS
               once it does, CONTENT once it cannot; in CONTENT, DeepSeek-V3's begin marker
               switches to MARKERS, where each call goes out whole as its end marker comes
The stream ends "tool_calls" when the model finished (not cut off) after complete calls;
cut off, it ends "length" with the last call's arguments as far as they got.
"""

from __future__ import annotations

import enum

from services.router.response_schemas import FunctionCallDelta, ToolCallDelta
from services.router.tool_stream import CallListScanner
from services.router.tools import (
    DEEPSEEK_CALL_END,
    DEEPSEEK_CALLS_BEGIN,
    ToolCalling,
    ToolMode,
    new_call_id,
    parse,
)


class _Stream(enum.Enum):
    CONTENT = "content"  # to the client as content
    UNDECIDED = "undecided"  # held: it may still open a JSON call list (auto)
    CALLS = "calls"  # a JSON call list, streamed call by call
    MARKERS = "markers"  # calls in DeepSeek-V3's markers, each sent once complete
    ARGUMENTS = "arguments"  # a named function's arguments, streamed as they come


class ChatText:
    """`route` each text delta, then `finish` once with the choice's finish reason."""

    def __init__(self, calling: ToolCalling | None) -> None:
        self.calling = calling
        self.held = ""  # text that is, or may become, tool calls
        self.mode = _Stream.CONTENT
        self.scanner: CallListScanner | None = None
        self._ids: list[str] = []  # per call sent: its id
        self._sent: list[int] = []  # per call sent: how much of its arguments
        if calling is not None:
            self.mode = {
                ToolMode.NAMED: _Stream.ARGUMENTS,
                ToolMode.REQUIRED: _Stream.CALLS,
                ToolMode.AUTO: _Stream.UNDECIDED,
            }[calling.mode]
            self.scanner = CallListScanner(frozenset(t.name for t in calling.tools))

    def route(self, text: str) -> tuple[str | None, list[ToolCallDelta]]:
        """What a text delta becomes on the wire: content (None: none), tool_calls deltas,
        or neither yet (held back)."""
        if self.mode is _Stream.ARGUMENTS:
            return None, self._arguments(text)
        if self.mode is _Stream.CONTENT:
            if self.calling is None or DEEPSEEK_CALLS_BEGIN not in text:
                return text, []
            before, marker, after = text.partition(DEEPSEEK_CALLS_BEGIN)
            self.mode, self.held = _Stream.MARKERS, ""
            return before or None, self._markers(marker + after)
        if self.mode is _Stream.MARKERS:
            return None, self._markers(text)
        assert self.scanner is not None
        self.held += text
        self.scanner.feed(text)
        if self.mode is _Stream.UNDECIDED:
            if self.scanner.opened:
                self.mode = _Stream.CALLS
            elif self.scanner.done:
                self.mode = _Stream.CONTENT
                held, self.held = self.held, ""
                return self.route(held)
            else:
                return None, []
        return None, self._scanned()

    def finish(self, reason: str) -> tuple[str | None, str]:
        """(content still held back, if any; the finish reason to send)."""
        if self.mode is _Stream.UNDECIDED:
            held, self.held = self.held, ""
            return held or None, reason
        if self.mode is _Stream.CONTENT or reason != "stop":
            return None, reason
        if self.mode is _Stream.CALLS:
            assert self.scanner is not None
            done = any(c.complete for c in self.scanner.calls)
            return None, "tool_calls" if done else reason
        return None, "tool_calls" if self._ids else reason

    def _arguments(self, text: str) -> list[ToolCallDelta]:
        if not text:
            return []
        assert self.calling is not None
        if self._ids:
            return [_fragment(0, text)]
        self._ids.append(new_call_id())
        return [_header(0, self._ids[0], self.calling.function.name, text)]

    def _scanned(self) -> list[ToolCallDelta]:
        """The deltas that bring the client up to the scanner's calls: a call goes out once
        its name is known, then its arguments as they grow."""
        assert self.scanner is not None
        deltas = []
        for k, call in enumerate(self.scanner.calls):
            if call.name is None:
                continue
            if k == len(self._ids):
                self._ids.append(new_call_id())
                self._sent.append(len(call.arguments))
                deltas.append(_header(k, self._ids[k], call.name, call.arguments))
            elif len(call.arguments) > self._sent[k]:
                deltas.append(_fragment(k, call.arguments[self._sent[k] :]))
                self._sent[k] = len(call.arguments)
        return deltas

    def _markers(self, text: str) -> list[ToolCallDelta]:
        """A DeepSeek-V3 call is sent whole once its end marker (a special token) comes."""
        self.held += text
        if DEEPSEEK_CALL_END not in text:
            return []
        assert self.calling is not None
        parsed = parse(self.held, self.calling)
        calls = parsed[1] if parsed is not None else []
        deltas = []
        for k in range(len(self._ids), len(calls)):
            self._ids.append(calls[k].id)
            deltas.append(_header(k, calls[k].id, calls[k].name, calls[k].arguments))
        return deltas


def _header(index: int, call_id: str, name: str, arguments: str) -> ToolCallDelta:
    return ToolCallDelta(
        index=index,
        id=call_id,
        type="function",
        function=FunctionCallDelta(name=name, arguments=arguments),
    )


def _fragment(index: int, arguments: str) -> ToolCallDelta:
    return ToolCallDelta(index=index, function=FunctionCallDelta(arguments=arguments))
