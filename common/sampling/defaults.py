"""The model's own sampling defaults: what a request gets for a sampling field it leaves out.

Model publishers put their recommended sampling in the model directory's
`generation_config.json` (HF's file); vLLM applies it to every request by default
(`--generation-config auto`). The router does the same, once at start-up, with the operator's
setting `TPLA_GENERATION_CONFIG` on top: `auto` (the file), `none` (the server's own
defaults only) or a JSON object of overrides over the file (vLLM's
`--override-generation-config`).

Read: `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, `max_new_tokens`
(the default `max_tokens`) and `do_sample`. `do_sample: false` means greedy, as in HF: the
default temperature is 0 (an override that names `temperature` or `do_sample` replaces the
file's `do_sample`). Other keys of the file (token ids, `transformers_version`) are not
sampling defaults and are ignored; an override names only the keys above. A request's
explicit value always wins; a field neither the request nor the defaults give takes the
server's own default (temperature 1, top_p 1, no top_k, min_p or repetition penalty).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common.runtime.errors import GenerationConfigError
from common.sampling.params import SamplingError, SamplingParams

FILE = "generation_config.json"
SETTING = "TPLA_GENERATION_CONFIG"
FLOAT_KEYS = ("temperature", "top_p", "min_p", "repetition_penalty")
INT_KEYS = ("top_k", "max_new_tokens")
KEYS = (*FLOAT_KEYS, *INT_KEYS, "do_sample")
_SERVER = SamplingParams()  # the server's own value of each field nobody gives
SERVER_MAX_TOKENS = 256  # capped by the context left


@dataclass(frozen=True)
class Sampling:
    """One request's sampling fields after the defaults are applied."""

    temperature: float
    top_p: float
    top_k: int  # 0 = off
    min_p: float
    repetition_penalty: float


@dataclass(frozen=True)
class GenerationDefaults:
    """The defaults in force; None where the server's own default applies. `source` says
    where they came from (the start-up log and `GET /v1/models` show it)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    source: str = "none"

    def __post_init__(self) -> None:
        try:  # the ranges a request is held to, checked in one place
            SamplingParams(
                max_tokens=1 if self.max_tokens is None else self.max_tokens,
                **asdict(self.sampling()),
            )
        except SamplingError as exc:
            raise GenerationConfigError(f"{self.source}: {exc}") from None

    def sampling(
        self,
        *,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
    ) -> Sampling:
        """A request's sampling fields (None: not given): its own value, else the default,
        else the server's. A top_k of -1 (vLLM's "off") is 0."""

        def pick(given: Any, default: Any, server: Any) -> Any:
            return given if given is not None else default if default is not None else server

        return Sampling(
            temperature=pick(temperature, self.temperature, _SERVER.temperature),
            top_p=pick(top_p, self.top_p, _SERVER.top_p),
            top_k=max(pick(top_k, self.top_k, _SERVER.top_k), 0),
            min_p=pick(min_p, self.min_p, _SERVER.min_p),
            repetition_penalty=pick(
                repetition_penalty, self.repetition_penalty, _SERVER.repetition_penalty
            ),
        )

    def max_tokens_for(self, left: int) -> int:
        """A request's max_tokens when it gives none, with `left` tokens of context left."""
        return min(self.max_tokens or SERVER_MAX_TOKENS, left)

    def describe(self) -> str:
        """One line for the start-up log: every default in force and where it came from."""
        values = " ".join(f"{k}={v}" for k, v in asdict(self.sampling()).items())
        cap = self.max_tokens or SERVER_MAX_TOKENS
        return f"sampling defaults ({self.source}): {values} max_tokens={cap} (or context left)"


def load_defaults(model_dir: str | Path, setting: str = "auto") -> GenerationDefaults:
    """The defaults for `model_dir` under TPLA_GENERATION_CONFIG = `setting`. A
    GenerationConfigError names the file or the setting, and the problem."""
    setting = setting.strip()
    if setting == "none":
        return GenerationDefaults(source=f"server ({SETTING}=none)")
    path = Path(model_dir) / FILE
    values: dict[str, Any] = {}
    sources = []
    if path.is_file():
        values = _file_values(path)
        sources.append(str(path))
    if setting != "auto":
        overrides = _overrides(setting)
        if "temperature" in overrides or "do_sample" in overrides:
            values.pop("do_sample", None)
        values |= overrides
        sources.append(SETTING)
    source = " + ".join(sources) or f"server (no {FILE})"
    if values.pop("do_sample", None) is False:
        values["temperature"] = 0.0
    max_tokens = values.pop("max_new_tokens", None)
    return GenerationDefaults(**values, max_tokens=max_tokens, source=source)


def _file_values(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GenerationConfigError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(raw, dict):
        raise GenerationConfigError(f"{path}: must hold a JSON object")
    # null is how HF writes a field it leaves unset.
    return _checked({k: raw[k] for k in KEYS if raw.get(k) is not None}, str(path))


def _overrides(setting: str) -> dict[str, Any]:
    try:
        raw = json.loads(setting)
    except json.JSONDecodeError as exc:
        raise GenerationConfigError(
            f"{SETTING} must be auto, none or a JSON object of overrides ({exc})"
        ) from None
    if not isinstance(raw, dict):
        raise GenerationConfigError(f"{SETTING} must be auto, none or a JSON object")
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise GenerationConfigError(
            f"{SETTING}: unknown keys {unknown}; the sampling defaults are {list(KEYS)}"
        )
    return _checked({k: v for k, v in raw.items() if v is not None}, SETTING)


def _checked(values: dict[str, Any], source: str) -> dict[str, Any]:
    """`values` with each key's type checked (JSON's `true` is no number, `1.5` no count)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key == "do_sample":
            ok, want = isinstance(value, bool), "true or false"
        elif key == "max_new_tokens":
            ok, want = type(value) is int and value >= 1, "an integer >= 1"
        elif key == "top_k":
            ok, want = type(value) is int and value >= -1, "an integer >= -1 (0 or -1: off)"
        else:
            ok, want = type(value) in (int, float), "a number"
            value = float(value) if ok else value
        if not ok:
            raise GenerationConfigError(f"{source}: {key} must be {want}, got {json.dumps(value)}")
        out[key] = value
    return out
