"""Tool calls read as the model writes them: an incremental scanner of the JSON call list
[{"name": NAME, "parameters": {...}}, ...], fed text deltas one after another.

After every delta it knows each call so far: its name once the name's string has closed,
and its arguments (the "parameters" object's text, exactly as generated) as far as they
have come. A call is complete at its object's closing brace, when its name is a known tool
and its arguments parse; the first call that is malformed ends the list, as in
`tools.parse`, the reference these states are tested against on every prefix of a text.

Lifecycle of a scan:  LIST -> ITEM -> KEY -> COLON -> VALUE -> AFTER_VALUE -> (KEY ...)
-> AFTER_ITEM -> (ITEM ...) -> DONE, at the closing bracket or at the first malformed
character; the text after DONE is not read.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from services.router.tools import JSON_WHITESPACE, unique_keys

_NAME = "name"
_ARGUMENTS = "parameters"
# Characters that end a number, true, false or null (the value's last character is the one
# before): what may follow a value in an object.
_AFTER_PRIMITIVE = frozenset(JSON_WHITESPACE + ",}]")


class _At(enum.Enum):
    LIST = "list"  # before "["
    ITEM = "item"  # after "[" or ",": a call object opens
    KEY = "key"  # a key's string opens
    COLON = "colon"
    VALUE = "value"  # a value's first character
    READING = "reading"  # inside a key or a value
    AFTER_VALUE = "after_value"  # "," or "}"
    AFTER_ITEM = "after_item"  # "," or "]"
    DONE = "done"  # the list closed, or it is malformed from here on


@dataclass
class ScannedCall:
    """One call of the list, as far as it has been generated."""

    name: str | None = None  # once its string has closed and names a known tool
    arguments: str = ""  # the parameters object's text so far
    complete: bool = False  # its object closed, name and arguments valid


class CallListScanner:
    """Feed the generated text with `feed`; read `calls`, `opened`, `closed`, `failed`."""

    def __init__(self, known: frozenset[str]) -> None:
        self.known = known
        self.calls: list[ScannedCall] = []
        self.opened = False  # the text is a call list (a complete call, or a known first name)
        self.closed = False  # the list's "]" came
        self.failed = False  # malformed from some character on: nothing after it counts
        self._at = _At.LIST
        self._keys: set[str] = set()  # the current object's keys
        self._key: str | None = None  # whose value is being read (None: a key is)
        self._raw: list[str] = []  # the key or value being read
        self._depth = 0  # of brackets and braces in the value being read
        self._in_string = False
        self._escaped = False
        self._primitive = False

    @property
    def done(self) -> bool:
        return self._at is _At.DONE

    def feed(self, text: str) -> None:
        for ch in text:
            if self._at is _At.DONE:
                return
            if self._at is _At.READING:
                if self._read(ch):
                    continue
                # A number or literal ends before `ch`, which the object reads next.
                self._value_read()
                if self._at is _At.DONE:
                    return
            self._structure(ch)

    def _structure(self, ch: str) -> None:
        """One character between keys and values."""
        at = self._at
        if ch in JSON_WHITESPACE:
            return
        if at is _At.LIST and ch == "[":
            self._at = _At.ITEM
        elif at is _At.ITEM and ch == "{":
            self.calls.append(ScannedCall())
            self._keys = set()
            self._at = _At.KEY
        elif at is _At.KEY and ch == '"':
            self._key = None
            self._start(ch)
        elif at is _At.COLON and ch == ":":
            self._at = _At.VALUE
        elif at is _At.VALUE and self._may_open(ch):
            self._start(ch)
        elif at is _At.AFTER_VALUE and ch == ",":
            self._at = _At.KEY
        elif at is _At.AFTER_VALUE and ch == "}":
            self._object_closed()
        elif at is _At.AFTER_ITEM and ch == ",":
            self._at = _At.ITEM
        elif at is _At.AFTER_ITEM and ch == "]":
            self.closed = True
            self._at = _At.DONE
        else:
            self._fail()

    def _may_open(self, ch: str) -> bool:
        """Whether `ch` may open the current key's value: a name is a string, the
        arguments an object."""
        if self._key == _NAME:
            return ch == '"'
        if self._key == _ARGUMENTS:
            return ch == "{"
        return True

    def _start(self, ch: str) -> None:
        self._raw = []
        self._depth = 0
        self._in_string = self._escaped = False
        self._primitive = ch not in '"{['
        self._at = _At.READING
        self._read(ch)

    def _read(self, ch: str) -> bool:
        """Take `ch` into the key or value being read; False when it is not part of it (it
        follows a number or literal)."""
        if self._primitive:
            if ch in _AFTER_PRIMITIVE:
                return False
            self._raw.append(ch)
            return True
        self._raw.append(ch)
        if self._key == _ARGUMENTS:
            self.calls[-1].arguments += ch
        ended = False
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                ended = self._depth == 0
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            ended = self._depth == 0
        if ended:
            self._value_read()
        return True

    def _value_read(self) -> None:
        """A key or value has been read whole: check it and move on."""
        raw = "".join(self._raw)
        try:
            value = json.loads(raw, object_pairs_hook=unique_keys)
        except ValueError:
            self._fail()
            return
        call = self.calls[-1]
        if self._key is None:  # it was a key
            if value in self._keys:
                self._fail()
                return
            self._keys.add(value)
            self._key = value
            self._at = _At.COLON
            return
        if self._key == _NAME:
            if value not in self.known:
                self._fail()
                return
            call.name = value
            if len(self.calls) == 1 and self._keys == {_NAME}:
                self.opened = True
        self._at = _At.AFTER_VALUE

    def _object_closed(self) -> None:
        call = self.calls[-1]
        if call.name is None or _ARGUMENTS not in self._keys:
            self._fail()
            return
        call.complete = True
        self.opened = True
        self._at = _At.AFTER_ITEM

    def _fail(self) -> None:
        self.failed = True
        self._at = _At.DONE
