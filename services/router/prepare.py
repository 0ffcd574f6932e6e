"""OpenAI request bodies -> `GenerationRequest` (the boundary where pydantic ends).

Checks what only the server can check (model name, context length, token id range, that a
structured output's grammar compiles), renders the chat template, tokenizes, and fills
defaults: max_tokens = min(256, context left); stop token ids = the request's stop_token_ids
plus the tokenizer's EOS ids unless ignore_eos.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from common.errors import InvalidRequest, NotFound
from common.grammar import GrammarCompiler, GrammarError, GrammarKind, GrammarSpec
from common.sampling import SamplingError, SamplingParams
from common.tokenizer import ChatMessage, Tokenizer, TokenizerError
from services.router import tools
from services.router.request import GenerationRequest
from services.router.schemas import ChatCompletionRequest, CompletionRequest

DEFAULT_MAX_TOKENS = 256
_FALLBACK_CONTEXT = 4096  # ModelConfig's default when config.json does not say
MAX_ECHOED_NAME = 128  # an error message need not repeat a megabyte of model name


def context_limit(model_dir: str | Path) -> int:
    """The model's context length: config.json's max_position_embeddings, further capped by
    tokenizer_config.json's model_max_length when that is a real (not sentinel) value."""
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
    return limit


@dataclass(frozen=True)
class ModelInfo:
    served_name: str
    tokenizer: Tokenizer
    max_model_len: int
    log_prompts: bool = False
    grammars: GrammarCompiler | None = None  # None: structured outputs are refused


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(16)}"


def prepare_chat(body: ChatCompletionRequest, info: ModelInfo, arrival: float) -> GenerationRequest:
    _check_model(body.model, info)
    calling = tool_calling(body)
    tool_grammar = tools.grammar(calling) if calling else None
    if tool_grammar is not None:  # a bad parameters schema says so before anything else
        _compiled(tool_grammar, info, "tools")
        if _grammar(body, info) is not None:
            raise InvalidRequest(
                "a required or named tool_choice cannot be combined with a structured output",
                param="tool_choice",
            )
    try:
        messages, tool_defs = chat_messages(body, calling, info.tokenizer)
        prompt_ids = info.tokenizer.encode_chat(messages, tools=tool_defs)
    except TokenizerError as exc:
        raise InvalidRequest(str(exc), param="messages") from exc
    top = body.top_logprobs or 0
    text = "\n".join(m.text for m in body.messages) if info.log_prompts else ""
    req = _build(
        "chatcmpl",
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
    if calling is None:
        return req
    # A model's own call markers are special tokens: the text must keep them to parse them.
    markers = len(info.tokenizer.encode(tools.DEEPSEEK_CALLS_BEGIN)) == 1
    return replace(req, tools=calling, keep_special_tokens=markers)


def tool_calling(body: ChatCompletionRequest) -> tools.ToolCalling | None:
    """The request's tool settings; None when no tool may be called."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    defs = tuple(
        tools.Tool(
            t.function.name,
            t.function.description or "",
            json.dumps(t.function.parameters or {"type": "object", "properties": {}}),
        )
        for t in body.tools
    )
    parallel = body.parallel_tool_calls is not False
    if choice is None or choice == "auto":
        return tools.ToolCalling(tools.ToolMode.AUTO, defs, parallel=parallel)
    if choice == "required":
        return tools.ToolCalling(tools.ToolMode.REQUIRED, defs, parallel=parallel)
    assert not isinstance(choice, str)
    if choice.function.name not in {t.name for t in defs}:
        raise InvalidRequest(
            f"tool_choice names function {choice.function.name!r}, which is not in tools",
            param="tool_choice",
        )
    return tools.ToolCalling(tools.ToolMode.NAMED, defs, choice.function.name, parallel)


def chat_messages(
    body: ChatCompletionRequest, calling: tools.ToolCalling | None, tokenizer: Tokenizer
) -> tuple[list[ChatMessage], list[dict[str, object]] | None]:
    """The conversation as the chat template reads it, and the tool definitions it renders
    itself (None: it renders none, and a system prompt describes the tools instead). A
    template without tool turns sees earlier calls as JSON and tool results as user turns."""
    native_turns = tokenizer.template_renders_tool_turns
    messages = []
    for m in body.messages:
        calls = tuple((c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ())
        if native_turns:
            messages.append(ChatMessage(m.template_role, m.text, calls, m.tool_call_id))
        elif m.role == "tool":
            messages.append(ChatMessage("user", f"Tool result ({m.tool_call_id}): {m.text}"))
        elif calls:
            content = tools.calls_json([(n, a) for _, n, a in calls])
            messages.append(ChatMessage("assistant", f"{m.text}\n{content}".lstrip()))
        else:
            messages.append(ChatMessage(m.template_role, m.text))
    if calling is None:
        return messages, None
    if tokenizer.template_renders_tools:
        return messages, [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.schema},
            }
            for t in calling.tools
        ]
    prompt = tools.system_prompt(calling.tools)
    if messages and messages[0].role == "system":
        messages[0] = replace(messages[0], content=f"{messages[0].content}\n\n{prompt}")
    else:
        messages.insert(0, ChatMessage("system", prompt))
    return messages, None


def prepare_completion(
    body: CompletionRequest, info: ModelInfo, arrival: float
) -> GenerationRequest:
    _check_model(body.model, info)
    if isinstance(body.prompt, str):
        prompt_ids = info.tokenizer.encode(body.prompt)
        text = body.prompt
    else:
        bad = [t for t in body.prompt if t >= info.tokenizer.vocab_size]
        if bad:
            raise InvalidRequest(
                f"prompt token ids {bad[:5]} are outside the vocabulary "
                f"(size {info.tokenizer.vocab_size})",
                param="prompt",
            )
        prompt_ids, text = list(body.prompt), ""
    want = body.logprobs is not None
    return _build(
        "cmpl",
        body,
        prompt_ids,
        body.token_limit,
        want,
        body.logprobs or 0,
        info,
        arrival,
        text if info.log_prompts else "",
    )


def _check_model(model: str, info: ModelInfo) -> None:
    if model != info.served_name:
        shown = model if len(model) <= MAX_ECHOED_NAME else model[:MAX_ECHOED_NAME] + "..."
        raise NotFound(
            f"The model `{shown}` does not exist. Available: `{info.served_name}`.",
            param="model",
            code="model_not_found",
        )


def _build(
    prefix: str,
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
    limit = info.max_model_len
    if not prompt_ids:
        raise InvalidRequest(
            "the prompt is empty", param="messages" if prefix == "chatcmpl" else "prompt"
        )
    if len(prompt_ids) >= limit:
        raise InvalidRequest(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"has {len(prompt_ids)} tokens. Please reduce the length of the prompt.",
            param="messages" if prefix == "chatcmpl" else "prompt",
            code="context_length_exceeded",
        )
    left = limit - len(prompt_ids)
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, left)
    elif max_tokens > left:
        raise InvalidRequest(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
            f"{max_tokens} for the completion). Please reduce the length of the prompt or "
            "max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    vocab = info.tokenizer.vocab_size
    _check_token_ids(body.stop_token_ids or (), vocab, "stop_token_ids")
    bias = tuple(sorted((int(k), v) for k, v in (body.logit_bias or {}).items()))
    _check_token_ids([t for t, _ in bias], vocab, "logit_bias")
    eos = () if body.ignore_eos else info.tokenizer.eos_token_ids
    stop_ids = tuple(sorted({*(body.stop_token_ids or ()), *eos}))
    grammar = tool_grammar or _grammar(body, info)
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
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(body.top_k, 0),
            seed=body.seed,
            stop_token_ids=stop_ids,
            ignore_eos=body.ignore_eos,
            logprobs=top_logprobs,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0,
            logit_bias=bias,
            min_tokens=body.min_tokens,
            min_p=body.min_p or 0.0,
            grammar=grammar,
        )
    except SamplingError as exc:
        raise InvalidRequest(str(exc)) from exc
    return GenerationRequest(
        request_id=new_request_id(prefix),
        prompt_ids=tuple(prompt_ids),
        params=params,
        stops=body.stop_list,
        stream=bool(body.stream),
        want_logprobs=want_logprobs,
        arrival=arrival,
        prompt_text=prompt_text,
    )


def _check_token_ids(ids: Sequence[int], vocab: int, param: str) -> None:
    bad = sorted(t for t in ids if not 0 <= t < vocab)
    if bad:
        raise InvalidRequest(
            f"{param}: token ids {bad[:5]} are outside the vocabulary (size {vocab})", param=param
        )


def _grammar(
    body: ChatCompletionRequest | CompletionRequest, info: ModelInfo
) -> GrammarSpec | None:
    """The request's structured output (response_format or structured_outputs), compiled
    once here so a bad one is a 400 naming the problem; None when the output is free."""
    spec, param = None, "structured_outputs"
    so = body.structured_outputs
    fmt = body.response_format
    if so is not None and fmt is not None and fmt.type != "text":
        raise InvalidRequest(
            "give either response_format or structured_outputs, not both", param=param
        )
    if fmt is not None and fmt.type == "json_object":
        spec, param = GrammarSpec.json_schema({"type": "object"}), "response_format"
    elif fmt is not None and fmt.type == "json_schema":
        assert fmt.json_schema is not None
        spec, param = GrammarSpec.json_schema(fmt.json_schema.schema_), "response_format"
    elif so is not None:
        if so.json_ is not None:
            schema = so.json_
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise InvalidRequest(
                        f"structured_outputs.json is not valid JSON: {exc}", param=param
                    ) from exc
            spec = GrammarSpec.json_schema(schema)
        elif so.regex is not None:
            spec = GrammarSpec(GrammarKind.REGEX, so.regex)
        elif so.choice is not None:
            spec = GrammarSpec(GrammarKind.CHOICE, json.dumps(so.choice))
        else:
            assert so.grammar is not None
            spec = GrammarSpec(GrammarKind.GRAMMAR, so.grammar)
    return None if spec is None else _compiled(spec, info, param)


def _compiled(spec: GrammarSpec, info: ModelInfo, param: str) -> GrammarSpec:
    """`spec` once it compiles (cached for the workers' copies of the same spec)."""
    if info.grammars is None:
        raise InvalidRequest(
            "this model serves no structured outputs (no tokenizer.json)", param=param
        )
    try:
        info.grammars.compile(spec)
    except GrammarError as exc:
        raise InvalidRequest(str(exc)[:2000], param=param) from exc
    return spec
