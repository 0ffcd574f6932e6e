"""The grammar compiler and matcher (common/sampling/grammar.py) over a real BPE tokenizer: masks,
EOS only where the grammar accepts, replay after migration, the LRU cache, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.sampling.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarKind,
    GrammarSpec,
    JsonWhitespace,
    allowed_now,
    allowed_tokens,
    new_bitmask,
)
from common.sampling.grammar_limits import GrammarLimits
from common.text.tokenizer import Tokenizer
from tests.tiny import CORPUS, train_tokenizer

EOS = 1


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Path]:
    path = tmp_path_factory.mktemp("grammar-tok")
    train_tokenizer(300, CORPUS).save(str(path / "tokenizer.json"))
    return Tokenizer.from_dir(path), path


def _compiler(tokenizer: tuple[Tokenizer, Path], cache_size: int = 8) -> GrammarCompiler:
    tok, path = tokenizer
    # The model's vocabulary may be wider than the tokenizer's (padded embeddings).
    text = (path / "tokenizer.json").read_text()
    return GrammarCompiler(text, tok.vocab_size + 20, [EOS], cache_size=cache_size)


def test_mask_allows_what_the_grammar_allows_and_eos_only_at_the_end(tokenizer) -> None:
    tok, _ = tokenizer
    compiler = _compiler(tokenizer)
    spec = GrammarSpec(GrammarKind.CHOICE, json.dumps(["cat", "catalog"]))
    m = compiler.matcher(spec)
    vocab = compiler.vocab_size
    allowed = allowed_now(m, vocab, "cpu")[0]
    assert not allowed[EOS] and not allowed[tok.vocab_size :].any()
    for t in allowed.nonzero().flatten().tolist():  # every allowed token starts a choice
        assert any(c.startswith(tok.decode([t])) for c in ("cat", "catalog"))
    for t in tok.encode("cat"):
        assert m.accept(t)
    allowed = allowed_now(m, vocab, "cpu")[0]
    assert allowed[EOS] and m.accepting and not m.finished  # "cat" may end or go on
    for t in tok.encode("alog"):
        assert m.accept(t)
    allowed = allowed_now(m, vocab, "cpu")[0]
    assert m.finished and allowed.nonzero().flatten().tolist() == [EOS]


def test_replay_resumes_where_the_tokens_left_off(tokenizer) -> None:
    tok, _ = tokenizer
    compiler = _compiler(tokenizer)
    spec = GrammarSpec(GrammarKind.REGEX, r"[a-z]{2}[0-9]{2}")
    done = tok.encode("ab")
    fresh = compiler.matcher(spec)
    for t in done:
        fresh.accept(t)
    resumed = compiler.matcher(spec, replay=done)
    vocab = compiler.vocab_size
    assert torch.equal(allowed_now(fresh, vocab, "cpu"), allowed_now(resumed, vocab, "cpu"))
    with pytest.raises(GrammarError, match="do not match"):
        compiler.matcher(spec, replay=tok.encode("1"))


def test_a_forked_matcher_goes_on_independently(tokenizer) -> None:
    """n > 1: each choice's matcher is forked from the request's before its first token; a
    fork starts where its parent stands and what one accepts does not move the other."""
    tok, _ = tokenizer
    compiler = _compiler(tokenizer)
    spec = GrammarSpec(GrammarKind.CHOICE, json.dumps(["cat", "dog"]))
    parent = compiler.matcher(spec)
    fork = parent.fork()
    vocab = compiler.vocab_size
    assert torch.equal(allowed_now(parent, vocab, "cpu"), allowed_now(fork, vocab, "cpu"))
    for t in tok.encode("cat"):
        assert parent.accept(t)
    for t in tok.encode("dog"):
        assert fork.accept(t)
    assert parent.finished and fork.finished
    assert not fork.fork().accept(tok.encode("cat")[0])  # a finished fork stays finished


def test_batch_bitmask_rows_and_unconstrained_rows(tokenizer) -> None:
    compiler = _compiler(tokenizer)
    mask = new_bitmask(3, compiler.mask_words)
    compiler.matcher(GrammarSpec(GrammarKind.REGEX, "x")).fill(mask[1])
    allowed = allowed_tokens(mask, compiler.vocab_size)
    assert allowed[0].all() and allowed[2].all()
    assert 0 < int(allowed[1].sum()) < 5


def test_cache_is_lru_and_bad_specs_name_the_problem(tokenizer) -> None:
    compiler = _compiler(tokenizer, cache_size=2)
    specs = [GrammarSpec(GrammarKind.REGEX, f"a{{{n}}}") for n in range(1, 4)]
    first = compiler.compile(specs[0])
    assert compiler.compile(specs[0]) is first  # a hit
    compiler.compile(specs[1])
    compiler.compile(specs[0])  # most recent again
    compiler.compile(specs[2])  # evicts specs[1]
    assert compiler.compile(specs[0]) is first
    assert len(compiler._cache) == 2 and specs[1] not in compiler._cache
    with pytest.raises(GrammarError, match="bogus"):
        compiler.compile(GrammarSpec.json_schema({"type": "bogus"}))
    with pytest.raises(GrammarError, match="regex"):
        compiler.compile(GrammarSpec(GrammarKind.REGEX, "[a-"))
    with pytest.raises(GrammarError, match="non-empty list of strings"):
        compiler.compile(GrammarSpec(GrammarKind.CHOICE, "[1]"))
    with pytest.raises(GrammarError, match="grammar"):
        compiler.compile(GrammarSpec(GrammarKind.GRAMMAR, "start: undefined_rule"))


# An ambiguous grammar: its parser's work per token grows with the tokens it has read.
AMBIGUOUS = GrammarSpec(GrammarKind.GRAMMAR, 'start: s\ns: s s | "a" | "b"\n')


def test_a_grammar_past_its_limits_stops_with_an_error_never_a_free_mask(tokenizer) -> None:
    tok, path = tokenizer
    text = (path / "tokenizer.json").read_text()
    strict = GrammarCompiler(text, tok.vocab_size, [EOS], GrammarLimits(step_max_items=100))
    m = strict.matcher(AMBIGUOUS)
    row = new_bitmask(1, strict.mask_words)[0]
    (a,) = tok.encode("a")
    with pytest.raises(GrammarError, match=r"cannot go on: .*Too many items"):
        for _ in range(100):
            m.fill(row)
            assert m.accept(a)
    assert m.error  # it stays stopped: every later mask raises too
    with pytest.raises(GrammarError):
        m.fill(row)
    # The same grammar under the default limits goes on past that point.
    m = _compiler(tokenizer).matcher(AMBIGUOUS)
    for _ in range(30):
        m.fill(row)
        assert m.accept(a)


def test_json_whitespace_is_bounded_by_default(tokenizer) -> None:
    tok, _ = tokenizer
    compiler = _compiler(tokenizer)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def takes(spec: GrammarSpec, text: str) -> bool:
        m = compiler.matcher(spec)
        return all(m.accept(t) for t in tok.encode(text))

    compact = GrammarSpec.json_schema(schema)
    assert compact == GrammarSpec.json_schema(schema, JsonWhitespace.COMPACT)
    assert takes(compact, '{"a":1}') and takes(compact, '{"a": 1}')
    assert not takes(compact, '{"a":  1}') and not takes(compact, '{\n"a": 1}')
    bounded = GrammarSpec.json_schema(schema, JsonWhitespace.BOUNDED)
    assert takes(bounded, '{\n    "a": 1\n}')
    assert not takes(bounded, "{" + " " * 17 + '"a": 1}')
    # A schema's own whitespace option does not lift the bound.
    loose = {**schema, "x-guidance": {"whitespace_flexible": True, "whitespace_pattern": None}}
    assert not takes(GrammarSpec.json_schema(loose), '{\n"a": 1}')
