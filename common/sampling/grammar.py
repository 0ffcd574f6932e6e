"""Structured outputs: grammars (JSON schema, regex, choice, Lark / GBNF) over the model's
tokenizer, compiled once per spec, and matchers that say which tokens may come next.

Library: llguidance. Both candidates (xgrammar, llguidance) run on CPU; llguidance is chosen
because its wheel has no dependencies (xgrammar pulls torch, transformers and triton, and this
project pins its own torch), it builds the token mask lazily per step (~50 us) instead of
compiling a schema up front, its matcher replays tokens and reports grammar errors as text we
can return in a 400, and it reads the vocabulary straight from the model's tokenizer.json.

Lifecycle of a constrained request: the router compiles its spec once (a bad spec is a 400);
the spec travels in SamplingParams; the prefill worker and the decode leader each take a fresh
matcher from their compiler's LRU cache (a deep copy of the compiled one), replay the tokens
the request generated before (a migrated request) and then, at every token, fill the row's
bitmask and consume the sampled token. The grammar allows EOS only where it accepts. A
grammar whose parser stops (a `GrammarLimits` limit, a rejected token) cannot say what may
come next: its mask raises GrammarError, and the request ends with that error (nothing is
sampled from an unconstrained row). The whitespace a JSON grammar allows is part of its spec
(`JsonWhitespace`), so every service compiles the same grammar whatever its settings.
"""

from __future__ import annotations

import enum
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llguidance
import torch
from torch import Tensor

from common.sampling.grammar_limits import DEFAULT_LIMITS, GrammarLimits

TOKENIZER_FILE = "tokenizer.json"
CACHE_SIZE = 128


class GrammarError(ValueError):
    """A grammar spec that does not compile, or a grammar that cannot go on (the message says
    why), or none can be used."""


class JsonWhitespace(enum.Enum):
    """The whitespace a JSON grammar allows between JSON tokens (`TPLA_JSON_WHITESPACE`).

    Free-form whitespace lets a model write blank after blank (greedy decoding of a small
    model does) until `max_tokens`, and grows the parser's work with every one of them."""

    # At most one space between two JSON tokens, no line breaks: `{"a":1}` and `{"a": 1}`
    # both, nothing longer. Bounded like vLLM's and SGLang's "disable any whitespace"
    # (llguidance's whitespace_flexible=false, no whitespace at all), without forcing a model
    # off the separators it writes.
    COMPACT = "compact"
    # A pretty-printer's indentation, bounded: at most 16 blanks between two JSON tokens.
    BOUNDED = "bounded"

    @property
    def options(self) -> dict[str, object]:
        """llguidance's JSON compile options for it."""
        if self is JsonWhitespace.COMPACT:
            return {"whitespace_pattern": " ?"}
        return {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}


class GrammarKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # spec: the schema, as JSON text
    REGEX = "regex"
    CHOICE = "choice"  # spec: a JSON list of strings
    GRAMMAR = "grammar"  # Lark (or GBNF) text


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    spec: str

    @classmethod
    def json_schema(
        cls, schema: dict[str, object], whitespace: JsonWhitespace = JsonWhitespace.COMPACT
    ) -> GrammarSpec:
        """The schema's grammar with `whitespace` between JSON tokens (over any whitespace
        option the schema's own `x-guidance` names): part of the spec, so every service
        compiles the same grammar whatever its settings."""
        options = schema.get("x-guidance")
        guidance = {**(options if isinstance(options, dict) else {}), **whitespace.options}
        return cls(
            GrammarKind.JSON_SCHEMA, json.dumps({**schema, "x-guidance": guidance}, sort_keys=True)
        )

    def to_llguidance(self) -> str:
        """The llguidance grammar text; GrammarError if the spec itself is malformed."""
        try:
            if self.kind is GrammarKind.JSON_SCHEMA:
                return llguidance.LLMatcher.grammar_from_json_schema(
                    self.spec,
                    defaults=JsonWhitespace.COMPACT.options,  # type: ignore[arg-type]
                )
            if self.kind is GrammarKind.REGEX:
                return llguidance.LLMatcher.grammar_from_regex(self.spec)
            if self.kind is GrammarKind.CHOICE:
                choices = json.loads(self.spec)
                if not choices or not all(isinstance(c, str) for c in choices):
                    raise GrammarError("choice must be a non-empty list of strings")
                return llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in choices)
                )
            return llguidance.grammar_from("grammar", self.spec)
        except (ValueError, TypeError) as exc:
            if isinstance(exc, GrammarError):
                raise
            raise GrammarError(f"invalid {self.kind.value}: {exc}") from exc


class GrammarMatcher:
    """One request's position in its grammar. Used by one thread at a time."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def fork(self) -> GrammarMatcher:
        """An independent matcher at this one's position (a forked sequence's)."""
        return GrammarMatcher(self._m.deep_copy())

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar rejects it."""
        return self._m.consume_token(token_id)

    def try_accept(self, token_id: int) -> bool:
        """Advance by a draft token if the grammar allows it; a rejected draft leaves the
        matcher where it was (no error state)."""
        return self._m.try_consume_tokens([token_id]) == 1

    def rollback(self, tokens: int) -> None:
        """Undo the last `tokens` accepted (drafts a speculative step did not keep)."""
        if tokens and not self._m.rollback(tokens):
            raise GrammarError(f"cannot roll back {tokens} tokens: {self.error}")

    @property
    def finished(self) -> bool:
        """Nothing but EOS can follow (the grammar is complete)."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def error(self) -> str:
        return self._m.get_error()

    def fill(self, row: Tensor) -> None:
        """Write the allowed tokens as bits into `row` (int32 [W], CPU, contiguous).
        GrammarError when the grammar cannot say (its parser stopped at a GrammarLimits
        limit, or an earlier error): nothing may then be sampled for it."""
        assert row.dtype == torch.int32 and row.is_contiguous() and not row.is_cuda
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        if self._m.is_error():
            raise GrammarError(f"the grammar cannot go on: {self._m.get_error()}")


class GrammarCompiler:
    """Grammars over one tokenizer: compiled once per spec (LRU), handed out as matchers.

    Thread-safe: the compiled matchers in the cache are only deep-copied."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        limits: GrammarLimits = DEFAULT_LIMITS,
        cache_size: int = CACHE_SIZE,
    ) -> None:
        self.vocab_size = vocab_size
        self._limits = limits.to_llguidance()
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
        )
        self._cache: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        limits: GrammarLimits = DEFAULT_LIMITS,
    ) -> GrammarCompiler | None:
        """The model's compiler, or None when it ships no tokenizer.json."""
        path = Path(model_dir) / TOKENIZER_FILE
        if not path.is_file():
            return None
        return cls(path.read_text(encoding="utf-8"), vocab_size, eos_token_ids, limits)

    @property
    def mask_words(self) -> int:
        """int32 words per bitmask row."""
        return (self.vocab_size + 31) // 32

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """The compiled grammar (cached); GrammarError naming the problem."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
        grammar = spec.to_llguidance()
        compiled = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        if compiled.is_error():
            raise GrammarError(f"invalid {spec.kind.value}: {compiled.get_error()}")
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: GrammarSpec, replay: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar, advanced past `replay` (tokens the
        request already generated). GrammarError if the grammar rejects them."""
        m = self.compile(spec).deep_copy()
        if replay and not m.consume_tokens(list(replay)):
            raise GrammarError(f"the generated tokens do not match the grammar: {m.get_error()}")
        return GrammarMatcher(m)


def new_bitmask(rows: int, words: int, pin: bool = False) -> Tensor:
    """A host bitmask buffer [rows, words] with every token allowed."""
    return torch.full((rows, words), -1, dtype=torch.int32, pin_memory=pin)


def allowed_tokens(bitmask: Tensor, vocab: int) -> Tensor:
    """Bits [B, W] int32 -> allowed tokens [B, vocab] bool, on the bitmask's device."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> bits) & 1).flatten(1)[:, :vocab].bool()


def allowed_now(matcher: GrammarMatcher, vocab: int, device: torch.device | str) -> Tensor:
    """[1, vocab] bool: the tokens one matcher allows next (a single row: the first token)."""
    mask = new_bitmask(1, (vocab + 31) // 32)
    matcher.fill(mask[0])
    return allowed_tokens(mask.to(device), vocab)
