"""One streamed chat choice's text on its way out: a reasoning model's reasoning apart from
its content (reasoning.py), and with tools, content or tool_calls deltas in OpenAI's shape
(a call's id, type and name in the first delta for its index, then its arguments in
fragments as they are generated).

Where the content goes (`_Stream`):
    named      ARGUMENTS from the first token: the function's arguments, streamed as they come
    required   CALLS: the JSON call list, read by tool_stream.CallListScanner as it grows
    auto       UNDECIDED (held back) while the text may still open a JSON call list; CALLS
               once it does, CONTENT once it cannot; in CONTENT, the model's call markup
               (tools.CallMarkup) switches to MARKERS at its begin marker, where each call
               goes out whole as its end marker comes (DSML, plain text: the end of a
               content delta that may still become the begin marker is held back)
The reasoning goes out as it comes, except DeepSeek-V3.2's DSML call blocks inside it (auto),
which go out as calls, each whole, numbered with the content's calls in one sequence.
The stream ends "tool_calls" when the model finished (not cut off) after complete calls;
cut off, it ends "length" with the last call's arguments as far as they got.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.text.deepseek_v32 import CALLS_BEGIN, CALLS_END
from services.router import dsml
from services.router.reasoning import ReasoningSplitter
from services.router.response_schemas import FunctionCallDelta, ToolCallDelta
from services.router.tool_stream import CallListScanner
from services.router.tools import CallMarkup, ToolCalling, ToolMode, new_call_id


class _Stream(enum.Enum):
    CONTENT = "content"  # to the client as content
    UNDECIDED = "undecided"  # held: it may still open a JSON call list (auto)
    CALLS = "calls"  # a JSON call list, streamed call by call
    MARKERS = "markers"  # calls in the model's markup, each sent once complete
    ARGUMENTS = "arguments"  # a named function's arguments, streamed as they come


@dataclass
class Routed:
    """What a text delta becomes on the wire (None: nothing of that kind yet)."""

    reasoning: str | None = None
    content: str | None = None
    calls: list[ToolCallDelta] = field(default_factory=list)


class _Block:
    """A block of calls in a markup, read as it grows (the text after its begin marker)."""

    def __init__(self, markup: CallMarkup) -> None:
        self.markup = markup
        self.text = ""
        self._sent = 0  # its calls already sent

    def feed(self, text: str) -> list[tuple[str, str, str | None]]:
        """The calls `text` completes (name, arguments JSON, the model's id), once each."""
        seen = max(len(self.text) - len(self.markup.call_end) + 1, 0)
        self.text += text
        if self.text.find(self.markup.call_end, seen) < 0:
            return []
        calls = self.markup.calls(self.text)
        new, self._sent = calls[self._sent :], len(calls)
        return new


class ChatText:
    """`route` each text delta, then `finish` once with the choice's finish reason."""

    def __init__(
        self, calling: ToolCalling | None, splitter: ReasoningSplitter | None = None
    ) -> None:
        self.calling = calling
        self.splitter = splitter
        self.held = ""  # content that is, or may become, tool calls
        self.mode = _Stream.CONTENT
        self.scanner: CallListScanner | None = None
        self._block: _Block | None = None  # MARKERS: the content's calls
        self._ids: list[str] = []  # per call sent: its id
        self._sent: list[int] = []  # per JSON call sent: how much of its arguments
        # DSML calls inside the reasoning: its held end, and the block being read in it.
        self._in_reasoning = (
            calling is not None
            and calling.mode is ToolMode.AUTO
            and calling.markup is CallMarkup.DSML
        )
        self._reasoning_held = ""
        self._reasoning_block: _Block | None = None
        if calling is not None:
            self.mode = {
                ToolMode.NAMED: _Stream.ARGUMENTS,
                ToolMode.REQUIRED: _Stream.CALLS,
                ToolMode.AUTO: _Stream.UNDECIDED,
            }[calling.mode]
            self.scanner = CallListScanner(frozenset(t.name for t in calling.tools))

    def route(self, text: str) -> Routed:
        """What a text delta becomes on the wire: reasoning, content, tool_calls deltas, or
        nothing yet (held back)."""
        if self.splitter is None:
            content, calls = self._content(text)
            return Routed(None, content, calls)
        reasoning, content = self.splitter.push(text)
        return self._both(reasoning, content)

    def finish(self, reason: str) -> tuple[Routed, str]:
        """(what was still held back, if anything; the finish reason to send)."""
        out = Routed()
        if self.splitter is not None:
            out = self._both(*self.splitter.finish())
        if self._reasoning_held:
            out.reasoning = (out.reasoning or "") + self._reasoning_held
            self._reasoning_held = ""
        if self.mode in (_Stream.UNDECIDED, _Stream.CONTENT) and self.held:
            out.content = (out.content or "") + self.held
            self.held = ""
        if reason != "stop":
            return out, reason
        if self.mode is _Stream.CALLS:
            assert self.scanner is not None
            done = any(c.complete for c in self.scanner.calls)
        else:
            done = bool(self._ids)
        return out, "tool_calls" if done else reason

    def _both(self, reasoning: str, content: str) -> Routed:
        out = Routed()
        if reasoning:
            out.reasoning, out.calls = self._reasoning(reasoning)
        if content:
            out.content, calls = self._content(content)
            out.calls += calls
        return out

    def _reasoning(self, text: str) -> tuple[str | None, list[ToolCallDelta]]:
        """Reasoning text to send, and the DSML calls it completes (auto tools)."""
        if not self._in_reasoning:
            return text, []
        buf, self._reasoning_held = self._reasoning_held + text, ""
        kept: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            block = self._reasoning_block
            if block is None:
                before, begin, buf = buf.partition(CALLS_BEGIN)
                if begin:
                    kept.append(before.rstrip(dsml.WHITESPACE))
                    self._reasoning_block = _Block(CallMarkup.DSML)
                    continue
                keep = dsml.held_tail(before, CALLS_BEGIN)
                kept.append(before[: len(before) - keep])
                self._reasoning_held = before[len(before) - keep :]
                break
            whole = block.text + buf
            at = whole.find(CALLS_END, max(len(block.text) - len(CALLS_END) + 1, 0))
            if at < 0:
                calls += self._headers(block.feed(buf))
                break
            calls += self._headers(block.feed(whole[len(block.text) : at]))
            self._reasoning_block, buf = None, whole[at + len(CALLS_END) :]
        return "".join(kept) or None, calls

    def _content(self, text: str) -> tuple[str | None, list[ToolCallDelta]]:
        if self.mode is _Stream.ARGUMENTS:
            return None, self._arguments(text)
        if self.mode is _Stream.CONTENT:
            if self.calling is None:
                return text, []
            return self._plain(text)
        if self.mode is _Stream.MARKERS:
            assert self._block is not None
            return None, self._headers(self._block.feed(text))
        assert self.scanner is not None
        self.held += text
        self.scanner.feed(text)
        if self.mode is _Stream.UNDECIDED:
            if self.scanner.opened:
                self.mode = _Stream.CALLS
            elif self.scanner.done:
                self.mode = _Stream.CONTENT
                held, self.held = self.held, ""
                return self._content(held)
            else:
                return None, []
        return None, self._scanned()

    def _plain(self, text: str) -> tuple[str | None, list[ToolCallDelta]]:
        """Content under auto, until the model's call markup begins."""
        assert self.calling is not None
        markup = self.calling.markup
        if not markup.plain_text:  # its begin marker is one token: never split
            before, begin, after = text.partition(markup.begin)
            if not begin:
                return text, []
        else:  # hold back what may become its begin marker (and the blanks before)
            before, begin, after = (self.held + text).partition(markup.begin)
            if not begin:
                keep = dsml.held_tail(before, markup.begin)
                self.held = before[len(before) - keep :]
                return before[: len(before) - keep] or None, []
            self.held, before = "", before.rstrip(dsml.WHITESPACE)
        self.mode, self._block = _Stream.MARKERS, _Block(markup)
        return before or None, self._headers(self._block.feed(after))

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

    def _headers(self, calls: list[tuple[str, str, str | None]]) -> list[ToolCallDelta]:
        """Whole calls (a markup's), each the next index (with the model's id if it gave one)."""
        deltas = []
        for name, arguments, call_id in calls:
            self._ids.append(call_id or new_call_id())
            deltas.append(_header(len(self._ids) - 1, self._ids[-1], name, arguments))
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
