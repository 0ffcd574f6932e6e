"""OpenAI request bodies -> `GenerationRequest` (the boundary where pydantic ends).

Checks what only the server can check (model name, context length, token id range, that a
structured output's grammar compiles), renders the chat template, tokenizes, and fills
defaults: the model's sampling defaults (common.sampling.defaults) for the fields a request
leaves out, max_tokens among them (at most the context left); stop token ids = the request's
stop_token_ids plus the tokenizer's EOS ids unless ignore_eos. A completions request becomes
one GenerationRequest per prompt of its batch.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from common.runtime.errors import InvalidRequest, NotFound, TokenizerError
from common.sampling.defaults import GenerationDefaults
from common.sampling.grammar import GrammarCompiler, GrammarSpec, JsonWhitespace
from common.sampling.params import SamplingError, SamplingParams
from common.text.chat_template import check_variables
from common.text.deepseek_v32 import DSML
from common.text.tokenizer import Tokenizer
from services.router import constraints, reasoning, tools
from services.router.chat_schemas import ChatCompletionRequest
from services.router.completion_schemas import CompletionRequest
from services.router.reasoning import ModelReasoning
from services.router.request import GenerationRequest

_FALLBACK_CONTEXT = 4096  # ModelConfig's default when config.json does not say
MAX_ECHOED_NAME = 128  # an error message need not repeat a megabyte of model name


def context_limit(model_dir: str | Path, max_model_len: int = 0) -> int:
    """The model's context length: config.json's max_position_embeddings, further capped by
    tokenizer_config.json's model_max_length when that is a real (not sentinel) value, and by
    `max_model_len` (TPLA_MAX_MODEL_LEN) when set."""
    directory = Path(model_dir)
    limit = _FALLBACK_CONTEXT
    config = directory / "config.json"
    if config.is_file():
        limit = int(json.loads(config.read_text()).get("max_position_embeddings", limit))
    tok_config = directory / "tokenizer_config.json"
    if tok_config.is_file():
        cap = json.loads(tok_config.read_text()).get("model_max_length")
        # HF writes ~1e30 when the tokenizer has no limit of its own.
        if isinstance(cap, int) and 0 < cap < 10**9:
            limit = min(limit, cap)
    return min(limit, max_model_len) if max_model_len else limit


def model_reasoning(
    setting: str, model_dir: str | Path, tokenizer: Tokenizer
) -> ModelReasoning | None:
    """How the model reasons (`TPLA_REASONING_PARSER`, else its config.json model_type and
    chat template); None when it does not. ValueError for a bad setting, or a family named
    for a model whose vocabulary has no </think> token (the workers end thinking by it)."""
    config = Path(model_dir) / "config.json"
    model_type = json.loads(config.read_text()).get("model_type", "") if config.is_file() else ""
    mentions = frozenset(m for m in reasoning.TEMPLATE_MARKS if tokenizer.template_reads(m))
    family = reasoning.family(setting, str(model_type), mentions)
    if family is None:
        return None
    ids = tokenizer.encode(reasoning.END, add_bos=False)
    if len(ids) != 1:
        if reasoning.parser_name(setting) == reasoning.AUTO:
            return None
        raise ValueError(
            f"TPLA_REASONING_PARSER={setting}: {reasoning.END} is not one token of the model's "
            "vocabulary"
        )
    special = tokenizer.decode(ids, skip_special_tokens=True) == ""
    return ModelReasoning(family, ids[0], special)


@dataclass(frozen=True)
class ModelInfo:
    served_name: str
    tokenizer: Tokenizer
    max_model_len: int
    log_prompts: bool = False
    grammars: GrammarCompiler | None = None  # None: structured outputs are refused
    json_whitespace: JsonWhitespace = JsonWhitespace.COMPACT  # between a JSON output's tokens
    # What a request gets for the sampling fields it leaves out.
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    reasoning: ModelReasoning | None = None  # None: the model does not reason
    call_markup: tools.CallMarkup = tools.CallMarkup.DEEPSEEK_V3  # its own tool-call markup


def call_markup(tokenizer: Tokenizer) -> tools.CallMarkup:
    """The markup the model writes tool calls in: the one its prompt format writes earlier
    calls in (DeepSeek-V3's markers when it names none of the others)."""
    for markup in (
        tools.CallMarkup.DSML,
        tools.CallMarkup.KIMI_K2,
        tools.CallMarkup.GLM45,
        tools.CallMarkup.MISTRAL,
    ):
        marker = DSML if markup is tools.CallMarkup.DSML else markup.begin
        if tokenizer.template_reads(marker):
            return markup
    return tools.CallMarkup.DEEPSEEK_V3


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(16)}"


def prepare_chat(body: ChatCompletionRequest, info: ModelInfo, arrival: float) -> GenerationRequest:
    _check_model(body.model, info)
    calling = constraints.tool_calling(body, info.call_markup)
    # Before the prompt is rendered: a bad parameters schema is the error to report.
    tool_grammar = constraints.tool_grammar(body, calling, info.grammars)
    variables = _template_variables(body)
    try:
        messages, tool_defs = constraints.chat_messages(body, calling, info.tokenizer)
        prompt_ids = info.tokenizer.encode_chat(messages, tools=tool_defs, variables=variables)
    except TokenizerError as exc:
        raise InvalidRequest(str(exc), param="messages") from exc
    thinking = info.reasoning is not None and reasoning.thinks(
        info.reasoning.family, info.tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
    )
    top = body.top_logprobs or 0
    text = "\n".join(m.text for m in body.messages) if info.log_prompts else ""
    req = _build(
        new_request_id("chatcmpl"),
        body,
        prompt_ids,
        body.token_limit,
        body.logprobs,
        top,
        info,
        arrival,
        text,
        tool_grammar,
    )
    if thinking:
        assert info.reasoning is not None
        # The workers end its thinking at </think>: a grammar starts there, a budget forces it.
        params = replace(
            req.params,
            think_end_ids=(info.reasoning.end_id,),
            thinking_budget=body.thinking_token_budget,
        )
        # Its markers may be special tokens: the text must keep them to split it.
        keep = info.reasoning.special
        req = replace(req, params=params, thinking=True, keep_special_tokens=keep)
    if calling is None:
        return req
    # A model's own call markers are special tokens: the text must keep them to parse them.
    begins = {tools.DEEPSEEK_CALLS_BEGIN, calling.markup.begin}
    markers = any(len(info.tokenizer.encode(m)) == 1 for m in begins)
    return replace(req, tools=calling, keep_special_tokens=markers or req.keep_special_tokens)


def _template_variables(body: ChatCompletionRequest) -> dict[str, Any]:
    """What the chat template reads besides the messages and tools: the request's
    chat_template_kwargs and its reasoning_effort."""
    variables = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        variables.setdefault("reasoning_effort", body.reasoning_effort)
    try:
        check_variables(variables)
    except TokenizerError as exc:
        raise InvalidRequest(str(exc), param="chat_template_kwargs") from exc
    return variables


def prepare_completion(
    body: CompletionRequest, info: ModelInfo, arrival: float
) -> tuple[str, list[GenerationRequest]]:
    """The response id and one request per prompt of the batch (in order). A batch's
    requests are <response id>-<k> in Redis and on the workers."""
    _check_model(body.model, info)
    response_id = new_request_id("cmpl")
    prompts = body.prompts
    reqs = []
    for k, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            prompt_ids, text = info.tokenizer.encode(prompt), prompt
        else:
            bad = [t for t in prompt if t >= info.tokenizer.vocab_size]
            if bad:
                raise InvalidRequest(
                    f"prompt token ids {bad[:5]} are outside the vocabulary "
                    f"(size {info.tokenizer.vocab_size})",
                    param="prompt",
                )
            prompt_ids = list(prompt)
            text = info.tokenizer.decode(prompt_ids) if body.echo or info.log_prompts else ""
        want = body.logprobs is not None
        score_only = body.max_tokens == 0  # (with echo: the schema checks)
        req = _build(
            response_id if len(prompts) == 1 else f"{response_id}-{k}",
            body,
            prompt_ids,
            1 if score_only else body.token_limit,
            want,
            body.logprobs or 0,
            info,
            arrival,
            text if info.log_prompts else "",
        )
        if body.echo:
            req = replace(
                req,
                echo_text=text,
                prompt_logprobs=body.logprobs if want else None,
                score_only=score_only,
            )
        reqs.append(req)
    return response_id, reqs


def _check_model(model: str, info: ModelInfo) -> None:
    if model != info.served_name:
        shown = model if len(model) <= MAX_ECHOED_NAME else model[:MAX_ECHOED_NAME] + "..."
        raise NotFound(
            f"The model `{shown}` does not exist. Available: `{info.served_name}`.",
            param="model",
            code="model_not_found",
        )


def _build(
    request_id: str,
    body: ChatCompletionRequest | CompletionRequest,
    prompt_ids: list[int],
    max_tokens: int | None,
    want_logprobs: bool,
    top_logprobs: int,
    info: ModelInfo,
    arrival: float,
    prompt_text: str,
    tool_grammar: GrammarSpec | None = None,
) -> GenerationRequest:
    max_tokens = _token_budget(request_id, prompt_ids, max_tokens, info)
    vocab = info.tokenizer.vocab_size
    _check_token_ids(body.stop_token_ids or (), vocab, "stop_token_ids")
    bias = tuple(sorted((int(k), v) for k, v in (body.logit_bias or {}).items()))
    _check_token_ids([t for t, _ in bias], vocab, "logit_bias")
    eos = () if body.ignore_eos else info.tokenizer.eos_token_ids
    stop_ids = tuple(sorted({*(body.stop_token_ids or ()), *eos}))
    grammar = tool_grammar or constraints.output_grammar(body, info.grammars, info.json_whitespace)
    if grammar is not None and body.ignore_eos:
        raise InvalidRequest(
            "ignore_eos cannot be combined with a structured output (it ends with EOS)",
            param="ignore_eos",
        )
    if body.min_tokens > max_tokens:
        raise InvalidRequest(
            f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_tokens})",
            param="min_tokens",
        )
    sampling = info.defaults.sampling(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
    )
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=body.seed,
            stop_token_ids=stop_ids,
            ignore_eos=body.ignore_eos,
            logprobs=top_logprobs,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=sampling.repetition_penalty,
            logit_bias=bias,
            min_tokens=body.min_tokens,
            min_p=sampling.min_p,
            grammar=grammar,
        )
    except SamplingError as exc:
        raise InvalidRequest(str(exc)) from exc
    return GenerationRequest(
        request_id=request_id,
        prompt_ids=tuple(prompt_ids),
        params=params,
        stops=body.stop_list,
        stream=bool(body.stream),
        want_logprobs=want_logprobs,
        arrival=arrival,
        prompt_text=prompt_text,
        n=body.choices,
    )


def _token_budget(
    request_id: str, prompt_ids: list[int], max_tokens: int | None, info: ModelInfo
) -> int:
    """The request's max_tokens (the model's default when it names none) within the context
    that the prompt leaves; InvalidRequest when the prompt or max_tokens does not fit."""
    limit = info.max_model_len
    prompt = "messages" if request_id.split("-", 1)[0] == "chatcmpl" else "prompt"
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty", param=prompt)
    if len(prompt_ids) >= limit:
        raise InvalidRequest(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"has {len(prompt_ids)} tokens. Please reduce the length of the prompt.",
            param=prompt,
            code="context_length_exceeded",
        )
    left = limit - len(prompt_ids)
    if max_tokens is None:
        return info.defaults.max_tokens_for(left)
    if max_tokens > left:
        raise InvalidRequest(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
            f"{max_tokens} for the completion). Please reduce the length of the prompt or "
            "max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def _check_token_ids(ids: Sequence[int], vocab: int, param: str) -> None:
    bad = sorted(t for t in ids if not 0 <= t < vocab)
    if bad:
        raise InvalidRequest(
            f"{param}: token ids {bad[:5]} are outside the vocabulary (size {vocab})", param=param
        )
