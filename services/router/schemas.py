"""What the OpenAI-compatible request bodies share: their sampling fields and the checks on
them (pydantic lives here and in chat_schemas.py / completion_schemas.py, at the HTTP edge
only; the response bodies are response_schemas.py).

Requests are validated here and converted by the pipeline into `SamplingParams` and plain
dataclasses; nothing past the route handlers sees a pydantic model. Validation is strict, as
OpenAI's is: `true`, `"5"` or `5.0` is not an integer and `"true"` is not a boolean. Unknown
fields are ignored (as vLLM does), but OpenAI fields we cannot honour (audio, completions'
best_of and suffix, ...) are rejected with a clear 400 naming the field instead of being
silently dropped. Sampling controls take OpenAI's ranges, and vLLM's for its extensions
(top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos,
structured_outputs). Strings must be valid Unicode: JSON can smuggle lone surrogates
(`"\\ud800"`) that no tokenizer, log line or Redis record can encode.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

MAX_STOPS = 4
MAX_CHOICES = 128  # OpenAI's limit on n
MAX_PROMPTS = 64  # prompts in one completions request
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries
MAX_STOP_TOKEN_IDS = 64
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seed travels as a protobuf int64
_MODEL_DEFAULT = "default: the model's generation_config.json (GET /v1/models shows it)"


def _valid_unicode(v: str) -> str:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (lone surrogates are not allowed)") from None
    return v


Text = Annotated[str, AfterValidator(_valid_unicode)]

# OpenAI parameters we do not implement, and the values that mean "not used" (accepted).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "best_of": (None, 1),
    "suffix": (None, ""),
}


def unsupported(description: str) -> Any:
    return Field(None, description=f"not supported: {description}")


class StructuredOutputs(BaseModel):
    """vLLM's structured-output constraints; exactly one is given."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = Field(None, min_length=1)
    choice: list[Text] | None = Field(None, min_length=1)
    grammar: Text | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [v for v in (self.json_, self.regex, self.choice, self.grammar) if v is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar")
        return self


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: Text = Field(max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = False


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object or json_schema."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is json_schema")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: Text
    max_tokens: int | None = Field(None, ge=1)
    # Sampling fields left out (None) take the model's defaults (common.sampling.defaults).
    temperature: float | None = Field(
        None, ge=0.0, le=2.0, allow_inf_nan=False, description=_MODEL_DEFAULT + ", else 1.0"
    )
    top_p: float | None = Field(
        None, gt=0.0, le=1.0, allow_inf_nan=False, description=_MODEL_DEFAULT + ", else 1.0"
    )
    top_k: int | None = Field(
        None,
        ge=-1,
        le=INT32_MAX,
        description="vLLM extension; 0 or -1 = disabled; " + _MODEL_DEFAULT + ", else off",
    )
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Text | list[Text] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = Field(None, max_length=256)
    n: int | None = Field(
        1, ge=1, le=MAX_CHOICES, description="choices, sharing one prefill of the prompt"
    )
    ignore_eos: bool = Field(False, description="vLLM extension")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(
        None, gt=0.0, le=2.0, allow_inf_nan=False, description="vLLM extension; 1 = off"
    )
    logit_bias: dict[str, float] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="token id (as a string) -> [-100, 100]"
    )
    min_tokens: int = Field(0, ge=0, le=INT32_MAX, description="vLLM extension")
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS, description="vLLM extension"
    )
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM extension: exactly one of json, regex, choice, grammar"
    )
    response_format: ResponseFormat | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences are supported")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (v or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError("keys must be token ids (decimal strings)")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"bias for token {key} must be in [-100, 100]")
        return v

    @field_validator(*_UNSUPPORTED, mode="after", check_fields=False)
    @classmethod
    def _not_implemented(cls, v: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None
        if v not in _UNSUPPORTED[info.field_name]:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def choices(self) -> int:
        return self.n or 1
