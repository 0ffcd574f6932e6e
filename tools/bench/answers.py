"""`tpla bench answers`: how a model's chat answers read at a grid of sampling settings, to
choose the defaults of its generation_config.json by measuring.

A fixed set of chat prompts in the demo's training style ("Write a Python function `name`:
summary") is answered in one process at every setting of the grid, several seeded samples
each. Per setting it reports the share of answers that parse as Python (`ast.parse`; an
answer cut off by max_tokens is parsed up to its last complete line), the share of
repeated lines (a greedy small model loops: repeated lines parse, but read badly) and the
share that ended by themselves (EOS) within max_tokens.

The answers are generated as one batch per setting (every prompt and sample a row of a
contiguous latent cache, sampled by `common.sampling.sampler.sample_batch` with the
request's logits processing), the batched form of `common.model.generate.generate`, which
its test holds it to.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tools.bench.output import table_stream

if TYPE_CHECKING:
    from common.model.causal_lm import DeepseekForCausalLM
    from common.sampling.params import SamplingParams

PROMPTS: tuple[str, ...] = (
    "Write a Python function `fib`",
    "Write a Python function `is_prime`",
    "Write a Python function `fibonacci`: Return the n-th Fibonacci number.",
    "Write a Python function `flatten`: Flatten a nested list into a single list.",
    "Write a Python function `read_lines`: Return the lines of a text file without newlines.",
    "Write a Python function `gcd`: Return the greatest common divisor of two integers.",
    "Write a Python function `chunks`: Yield successive n-sized chunks from a sequence.",
    "Write a Python function `is_palindrome`: Return True if the string reads the same backwards.",
    "Write a Python function `merge_dicts`: Merge two dictionaries into a new one.",
    "Write a Python function `count_words`: Return a dict mapping each word to its count.",
    "Write a Python function `parse_header`: Parse a header line into a name and a value.",
    "Write a Python function `quote`: Quote a string for use in a shell command.",
    "Write a Python function `normalize_path`: Normalize a path, collapsing redundant separators.",
    "Write a Python function `unique`: Return the unique items of a list, in order.",
    "Write a Python function `to_bytes`: Encode a string as UTF-8 bytes.",
    "Write a Python function `format_size`: Format a number of bytes as a human-readable string.",
)


@dataclass(frozen=True)
class Setting:
    temperature: float
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    @property
    def label(self) -> str:
        return (
            f"temperature {self.temperature:g}, top_p {self.top_p:g}, "
            f"repetition_penalty {self.repetition_penalty:g}"
        )


@dataclass(frozen=True)
class Score:
    setting: Setting
    answers: int
    parses: float  # share of answers that parse as Python
    repeated_lines: float  # share of non-blank lines that repeat an earlier line of the answer
    stopped: float  # share that ended by EOS within max_tokens
    mean_tokens: float


def grid(
    temperatures: Sequence[float], top_ps: Sequence[float], penalties: Sequence[float]
) -> list[Setting]:
    """Every combination, except top_p below 1 at temperature 0 (greedy ignores it)."""
    return [
        Setting(t, p, r)
        for t, p, r in itertools.product(temperatures, top_ps, penalties)
        if t > 0 or p == max(top_ps)
    ]


def parses(text: str, finished: bool) -> bool:
    """Whether the answer parses as Python; a cut-off one up to its last complete line."""
    if not finished:
        text = text[: text.rfind("\n") + 1]
    if not text.strip():
        return False
    try:
        ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    return True


def repeated_lines(text: str) -> float:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return 1.0 - len(set(lines)) / len(lines) if lines else 0.0


def generate_batch(
    model: DeepseekForCausalLM,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    eos_ids: Sequence[int],
) -> list[tuple[list[int], str]]:
    """Each row's generated ids and finish reason ("stop" or "length"): row b continues
    prompts[b] under params[b], with keyed draws as `generate` makes them."""
    import torch

    from common.model.contiguous_cache import ContiguousLatentCache
    from common.sampling.keyed import DrawKey
    from common.sampling.logits import context_for
    from common.sampling.sampler import request_seed, sample_batch

    device = model.lm_head.weight.device
    rows = len(prompts)
    lens = [len(p) for p in prompts]
    total = max(n + p.max_tokens for n, p in zip(lens, params, strict=True))
    packed = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
    out = model.prefill(packed, lens)
    cache = ContiguousLatentCache(model.config, rows, total, model.lm_head.weight.dtype, device)
    start = 0
    for b, n in enumerate(lens):
        cache.load_prefill(b, out, start, start + n)
        start += n
    seeds = [request_seed(p) for p in params]
    eos = frozenset(eos_ids)
    vocab = model.config.vocab_size
    outputs: list[list[int]] = [[] for _ in prompts]
    reasons: list[str | None] = [None] * rows
    logits = out.logits
    while True:
        context = context_for(params, prompts, outputs, eos, vocab, device)
        keys = [
            DrawKey(seed, 0, n + len(o)) for seed, n, o in zip(seeds, lens, outputs, strict=True)
        ]
        for b, tok in enumerate(sample_batch(logits, params, keys, context)):
            if reasons[b] is None:
                outputs[b].append(tok.token_id)
                reasons[b] = params[b].finish_reason(tok.token_id, len(outputs[b]), eos)
        if all(r is not None for r in reasons):
            break
        # Finished rows step on with their last token: the batch keeps its shape, and what
        # they sample is dropped.
        last = torch.tensor([o[-1] for o in outputs], device=device)
        positions = torch.tensor([n + len(o) - 1 for n, o in zip(lens, outputs, strict=True)])
        logits = model.decode(last, positions.to(device), cache)
    return [(o, r or "length") for o, r in zip(outputs, reasons, strict=True)]


def score(
    model: DeepseekForCausalLM,
    tokenizer: Any,
    setting: Setting,
    *,
    samples: int,
    max_tokens: int,
    prompts: Sequence[str] = PROMPTS,
) -> Score:
    """The answers to every prompt at `setting` (one sample at temperature 0, else
    `samples`, seeded 0 .. samples - 1)."""
    from common.sampling.params import SamplingParams
    from common.text.chat_template import ChatMessage

    eos = sorted(tokenizer.eos_token_ids)
    seeds = range(1 if setting.temperature == 0 else samples)
    ids = [tokenizer.encode_chat([ChatMessage("user", p)]) for p in prompts]
    rows = [(i, seed) for i in range(len(prompts)) for seed in seeds]
    params = [
        SamplingParams(max_tokens=max_tokens, seed=seed, **asdict(setting)) for _, seed in rows
    ]
    done = generate_batch(model, [ids[i] for i, _ in rows], params, eos)
    texts = [(tokenizer.decode(out), reason == "stop") for out, reason in done]
    n = len(texts)
    return Score(
        setting,
        n,
        parses=sum(parses(t, f) for t, f in texts) / n,
        repeated_lines=sum(repeated_lines(t) for t, _ in texts) / n,
        stopped=sum(f for _, f in texts) / n,
        mean_tokens=sum(len(out) for out, _ in done) / n,
    )


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def run(args: argparse.Namespace) -> int:
    import torch

    from common.loading.loader import load_model
    from common.text.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    tokenizer = Tokenizer.from_dir(args.model)
    settings = grid(
        _floats(args.temperatures), _floats(args.top_p), _floats(args.repetition_penalty)
    )
    out = table_stream(args.json)
    print(
        f"{len(PROMPTS)} prompts, {args.samples} samples each when sampling, "
        f"max_tokens {args.max_tokens}, {args.model}",
        file=out,
    )
    print("| setting | parses | repeated lines | ended by EOS | mean tokens |", file=out)
    print("|---|---|---|---|---|", file=out)
    scores = []
    t0 = time.monotonic()
    for setting in settings:
        s = score(model, tokenizer, setting, samples=args.samples, max_tokens=args.max_tokens)
        scores.append(s)
        print(
            f"| {setting.label} | {s.parses:.0%} | {s.repeated_lines:.0%} | {s.stopped:.0%} "
            f"| {s.mean_tokens:.0f} |",
            file=out,
            flush=True,
        )
    print(f"({time.monotonic() - t0:.0f} s)", file=out)
    if args.json:
        print(
            json.dumps(
                {
                    "model": str(args.model),
                    "prompts": list(PROMPTS),
                    "samples": args.samples,
                    "max_tokens": args.max_tokens,
                    "scores": [asdict(s) for s in scores],
                }
            )
        )
    return 0


def add_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bsub.add_parser(
        "answers", help="share of chat answers that parse as Python, per sampling setting"
    )
    p.add_argument("--model", default="models/demo")
    p.add_argument("--temperatures", default="0,0.3,0.6,1.0", help="comma-separated")
    p.add_argument("--top-p", default="1.0,0.9", help="comma-separated")
    p.add_argument("--repetition-penalty", default="1.0,1.1", help="comma-separated")
    p.add_argument("--samples", type=int, default=3, help="seeded samples per prompt")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--json", action="store_true", help="stdout is the JSON result alone")
    p.set_defaults(func=run)
