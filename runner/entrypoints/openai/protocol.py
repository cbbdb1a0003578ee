"""The OpenAI-compatible request bodies `dsrun serve` accepts, parsed strictly at the edge: a wrong type, an
unknown field or an unsupported option is a 400 that names it, before anything reaches the engine.

Every parameter OpenAI documents for Chat Completions and Completions is a field here. Those that change the output
are applied (`logit_bias`, `reasoning_effort`); those that mean nothing to a self-hosted server are accepted and
ignored (IGNORED_FIELDS); those asking for what this server cannot do (audio output, web search, the deprecated
`functions`) are a 400 that says so. A field that is in no spec stays a 400 naming it, so a typo never passes."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from dsconv.errors import InputError
from dsconv.family.dsml import Dialect
from dsconv.family.text import check_tools
from dsconv.runner.engine.kv_transfer import Export, Offer, Offers
from dsconv.runner.engine.grammar import GrammarSpec, json_spec, tool_call_spec
from dsconv.runner.engine.request import SamplingParams

SEED_LIMIT = 2**63  # seeds are int64, as in OpenAI's API
TOKEN_ID_TEXT = re.compile(rf"-?[0-9]{{1,{len(str(2**63))}}}")  # a logit_bias key: an int64 as text
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat defaults to what the context leaves)
DEFAULT_TEMPERATURE = 1.0  # OpenAI's and vLLM's default; SamplingParams' own default (greedy) is for dsrun generate
THINKING_KEYS = ("thinking", "enable_thinking")  # DeepSeek-V3.1's template reads the first, Qwen's the second
# reasoning_effort (OpenAI's) is the thinking switch: these values turn thinking off, the others on
REASONING_EFFORTS_OFF, REASONING_EFFORTS_ON = ("none", "minimal"), ("low", "medium", "high", "xhigh")
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value: -100 (ban) to 100 (exclusive selection)
# OpenAI parameters that do not apply to a self-hosted server: accepted and ignored (docs/serve.md lists them)
IGNORED_FIELDS = ("store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
                  "safety_identifier", "user", "prediction", "verbosity")

# The deepest nesting a body may have: a tool's JSON schema is the deepest part of a real request, and schemas
# nest a few levels per object; past this it is an attack on the parsers' recursion (json, pydantic, xgrammar)
MAX_JSON_DEPTH = 64
SURROGATE = re.compile("[\ud800-\udfff]")  # what json.loads makes of an unpaired \\uD800 to \\uDFFF escape
# fields that name things (the model, a role, a message's author, a tool, a salt): NUL is refused there
NUL_FREE = ("model", "role", "name", "cache_salt", "user", "type")
CONTAINERS = (str, dict, list)  # what check_text looks into

# The error `type` OpenAI's API writes for a status (its SDKs pick the exception class by status); any other 4xx is
# an invalid request, any 5xx a server error
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}; `param` names the
    request field at fault and `code` is OpenAI's string code, where there is one."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        error_type = ERROR_TYPES.get(self.status) or ("server_error" if self.status >= 500 else
                                                       "invalid_request_error")
        return {"error": {"message": str(self), "type": error_type, "param": self.param, "code": self.code}}


def model_not_found(model: str, served: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist; this server serves `{served}`.", "model",
                    "model_not_found")


class _Body(BaseModel):
    # strict: "16" is not a number and true is not 1; unknown fields are refused rather than ignored
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension; -1 or 0: off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as text) -> a bias in [-100, 100] added to its logit
    user: str | None = None  # accepted and ignored, as by OpenAI's API for abuse tracking
    return_tokens_as_token_ids: bool = False  # vLLM's extension: logprob tokens as "token_id:<id>"
    cache_salt: str | None = None  # vLLM's extension: only requests with the same salt share prefix-cache blocks
    # vLLM's sampling and request extensions, with its names, defaults and meanings (SamplingParams has their rules)
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True  # special tokens left out of the text
    spaces_between_special_tokens: bool = True  # a slow tokenizer's decode option: see `check_common`
    include_stop_str_in_output: bool = False  # the stop string that ended the text kept at its end
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: the last max_model_len)
    priority: int = 0  # with --scheduling-policy priority: lower first
    use_beam_search: bool = False  # only false: no beam search here
    # vLLM's P/D hand-over (engine/kv_transfer.py): {"do_remote_decode": true} to a producer; the producer's
    # response's kv_transfer_params, with "do_remote_prefill": true, to a consumer (`dsrun router` sends both)
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS in front of a text prompt, by its rule
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None  # insertion: refused unless empty


class ChatCompletionRequest(_Sampling):
    messages: list[Any]
    add_special_tokens: bool = False  # vLLM's: the tokenizer's BOS again, before the chat template's own
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None  # OpenAI function schemas: [{"type": "function", "function": {...}}]
    tool_choice: str | dict[str, Any] | None = None  # "none", "auto" (the default with tools), "required", a name
    parallel_tool_calls: bool | None = None  # false: at most one call per reply
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    reasoning_effort: str | None = None  # the thinking switch: none / minimal off, low / medium / high / xhigh on
    modalities: list[str] | None = None  # ["text"] only
    # ignored (IGNORED_FIELDS)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    prediction: dict[str, Any] | None = None  # predicted output: a speed hint, the output is the same without it
    verbosity: str | None = None
    # refused when set: what this server cannot do
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class ReleaseRequest(_Body):
    transfer_id: str  # a producer's hand-over (kv_transfer_params' transfer_id) whose blocks may go


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


Body = TypeVar("Body", bound=_Body)


def parse_body(raw: bytes, model: type[Body]) -> Body:
    data = load_body(raw)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        fields = {str(error["loc"][0]) for error in exc.errors() if error["loc"]}
        raise APIError(400, describe(exc), param=fields.pop() if len(fields) == 1 else None) from None


def load_body(raw: bytes) -> dict:
    """A body as JSON text holding an object whose every string is Unicode text (check_text), else a 400."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # json's decoder recurses once per level: past Python's stack, far past MAX_JSON_DEPTH
        raise APIError(400, "the request body nests too deeply to parse") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    check_text(data)
    return data


def _no_constant(name: str):
    """Python's json reads NaN, Infinity and -Infinity, which JSON (RFC 8259) has no place for."""
    raise APIError(400, f"the request body is not valid JSON: {name} is not a JSON number")


def check_text(data: dict) -> None:
    """Every string of a parsed body (object keys too) as Unicode text the engine can hold, else a 400 naming the
    field: JSON's \\u escapes can spell a lone surrogate (U+D800-U+DFFF), which no UTF-8 encoder (the tokenizer,
    the prefix cache's hashes) accepts; NUL is refused in the fields that name things (NUL_FREE), where no name
    holds it and C libraries would cut the name there; nesting is bounded (MAX_JSON_DEPTH). Iterative, so a deep
    body cannot exhaust the stack here."""
    for key in data:
        _check_string("a field's name", key, None)
    stack: list[tuple[str, object, int]] = [(key, value, 1) for key, value in data.items()]
    while stack:
        path, value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"{path} nests deeper than {MAX_JSON_DEPTH} levels", _field(path))
        if isinstance(value, str):
            _check_string(path, value, _field(path))
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_string(f"{path} key", key, _field(path))
                if isinstance(item, CONTAINERS):
                    stack.append((f"{path}.{key}", item, depth + 1))
        elif isinstance(value, list):  # a prompt of token ids is a long list of ints: no path made for those
            stack.extend((f"{path}[{i}]", item, depth + 1) for i, item in enumerate(value)
                         if isinstance(item, CONTAINERS))


def _check_string(path: str, text: str, param: str | None) -> None:
    surrogate = SURROGATE.search(text)
    if surrogate is not None:
        raise APIError(400, f"{path} holds a lone surrogate (U+{ord(surrogate.group()):04X} at character "
                            f"{surrogate.start()}): not Unicode text", param)
    if "\0" in text and _leaf(path) in NUL_FREE:
        raise APIError(400, f"{path} holds a NUL character, which a name cannot hold", param)


def _field(path: str) -> str:
    """The top-level request field a path is in (OpenAI's `param`)."""
    return re.split(r"[.\[ ]", path, maxsplit=1)[0]


def _leaf(path: str) -> str:
    return re.split(r"[.\]]", path.removesuffix(" key"))[-1]


def describe(exc: ValidationError) -> str:
    """One line naming each bad field; a union field lists the shapes it accepts instead of one error per shape."""
    by_field: dict[str, list[dict]] = {}
    for error in exc.errors():
        by_field.setdefault(str(error["loc"][0]) if error["loc"] else "body", []).append(error)
    parts = []
    for field, errors in by_field.items():
        if errors[0]["type"] == "extra_forbidden":
            parts.extend(f"unsupported field {'.'.join(map(str, e['loc']))!r}" for e in errors)
            continue
        branches = list(dict.fromkeys(str(e["loc"][1]) for e in errors if len(e["loc"]) > 1))
        if len(branches) > 1:
            parts.append(f"{field} must be one of: {', '.join(branches)}")
        else:
            where = ".".join(str(part) for part in errors[0]["loc"])
            parts.append(f"{where}: {errors[0]['msg']}")
    return "; ".join(parts)


def check_common(body: _Sampling, model_name: str, vocab_size: int) -> None:
    """What the two generation routes refuse alike; SamplingParams checks the ranges it knows itself."""
    if body.model is not None and body.model != model_name:
        raise model_not_found(body.model, model_name)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0.0):
            raise InputError(f"{name}={getattr(body, name)} is not supported: only 0")
    if body.stream_options is not None and not body.stream:
        raise InputError("stream_options is only allowed with stream=true")
    if body.use_beam_search:
        raise APIError(400, "use_beam_search=true is not supported: this server has no beam search",
                       "use_beam_search")
    if body.truncate_prompt_tokens is not None and body.truncate_prompt_tokens < -1 \
            or body.truncate_prompt_tokens == 0:
        raise APIError(400, f"truncate_prompt_tokens must be -1 (the last max_model_len tokens) or at least 1, got "
                            f"{body.truncate_prompt_tokens}", "truncate_prompt_tokens")
    # spaces_between_special_tokens: accepted either way. vLLM hands it to the tokenizer's decode, where only slow
    # (Python) tokenizers read it; DeepSeek's are fast (byte-level) ones, whose decode has no such option, so vLLM's
    # text does not depend on it either (tests/test_serve_api.py checks transformers' decode of the real tokenizer).
    if body.top_k is not None and body.top_k < -1:
        raise InputError(f"top_k must be -1 or 0 (off) or positive, got {body.top_k}")
    if body.seed is not None and not -SEED_LIMIT <= body.seed < SEED_LIMIT:
        raise InputError(f"seed must be a 64-bit signed integer, got {body.seed}")
    if any(not stop for stop in stop_strings(body)):
        raise InputError("stop strings must not be empty")
    for token_id in body.stop_token_ids or ():
        check_token_id(token_id, vocab_size, "stop_token_ids")


def logit_bias(body: _Sampling, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, bias) pairs, checked: keys are token ids written as text (JSON object keys are
    text), values in [-100, 100]."""
    pairs = []
    for key, bias in (body.logit_bias or {}).items():
        # int() refuses texts of over 4,300 digits with a ValueError: an id is an int64, at most 19 digits
        if not TOKEN_ID_TEXT.fullmatch(key):
            raise APIError(400, f"logit_bias keys are token ids, got {key!r}", "logit_bias")
        check_token_id(int(key), vocab_size, "logit_bias")
        if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise APIError(400, f"logit_bias[{key}] must be between -100 and 100, got {bias}", "logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def stop_strings(body: _Sampling) -> tuple[str, ...]:
    if body.stop is None:
        return ()
    return (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)


def check_token_id(token_id: int, vocab_size: int, where: str) -> None:
    if not 0 <= token_id < vocab_size:
        raise InputError(f"{where} holds token id {token_id}, outside the vocabulary [0, {vocab_size})")


def sampling_params(body: _Sampling, max_tokens: int, logprobs: int | None, vocab_size: int,
                    prompt_logprobs: int | None = None, grammar: GrammarSpec | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **sampling_fields(body, logprobs, vocab_size, prompt_logprobs,
                                                                   grammar))


def sampling_fields(body: _Sampling, logprobs: int | None, vocab_size: int, prompt_logprobs: int | None = None,
                    grammar: GrammarSpec | None = None) -> dict:
    """The body's SamplingParams, but max_tokens (vLLM's to_sampling_params)."""
    return dict(
        temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),  # -1 is vLLM's "off", 0 ours
        seed=body.seed,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        grammar=grammar,
        n=1 if body.n is None else body.n,
        logit_bias=logit_bias(body, vocab_size),
        cache_salt=body.cache_salt,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        min_p=0.0 if body.min_p is None else body.min_p,
        min_tokens=body.min_tokens,
        priority=body.priority,
        kv_transfer=handoff(body),
    )


def handoff(body: _Sampling) -> Export | Offer | Offers | None:
    """kv_transfer_params -> what the engine does with the request's cache (InputError when malformed)."""
    raw = body.kv_transfer_params
    if not raw:
        return None
    if raw.get("do_remote_decode"):
        if body.stream:
            raise InputError("kv_transfer_params do_remote_decode: the producer's reply carries the hand-over, so "
                             "it cannot be streamed (stream false)")
        return Export()
    if raw.get("do_remote_prefill"):
        return Offers.from_params(raw) if "prompts" in raw else Offer.from_params(raw)
    raise InputError("kv_transfer_params must hold do_remote_decode (to a producer) or do_remote_prefill with the "
                     "producer's params (to a consumer)")


def truncate(ids: list[int], body: _Sampling, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: the last max_model_len)."""
    keep = kept_tokens(body, max_model_len)
    return ids if keep is None else ids[-keep:]


def kept_tokens(body: _Sampling, max_model_len: int) -> int | None:
    """How many of the prompt's last tokens truncate_prompt_tokens keeps (None: all)."""
    keep = body.truncate_prompt_tokens
    return max_model_len if keep == -1 else keep


def thinking_flag(kwargs: dict[str, Any] | None, reasoning_effort: str | None = None) -> bool:
    """The thinking switch (off by default) from chat_template_kwargs or reasoning_effort (none / minimal: off; low,
    medium, high, xhigh: on); other template kwargs are refused, not ignored, and the two may not disagree."""
    kwargs = kwargs or {}
    unknown = sorted(set(kwargs) - set(THINKING_KEYS))
    if unknown:
        raise InputError(f"chat_template_kwargs {', '.join(map(repr, unknown))} not supported; "
                         f"only {' / '.join(THINKING_KEYS)}")
    values = {key: kwargs[key] for key in THINKING_KEYS if key in kwargs}
    for key, value in values.items():
        if not isinstance(value, bool):
            raise InputError(f"chat_template_kwargs.{key} must be true or false, got {value!r}")
    if reasoning_effort is not None:
        if reasoning_effort not in REASONING_EFFORTS_OFF + REASONING_EFFORTS_ON:
            efforts = ", ".join(REASONING_EFFORTS_OFF + REASONING_EFFORTS_ON)
            raise APIError(400, f"reasoning_effort must be one of {efforts}, got {reasoning_effort!r}",
                           "reasoning_effort")
        values["reasoning_effort"] = reasoning_effort in REASONING_EFFORTS_ON
    if len(set(values.values())) > 1:
        raise InputError(f"the thinking switches disagree: {', '.join(f'{k}={v}' for k, v in values.items())}")
    return next(iter(values.values()), False)


def check_chat_fields(body: ChatCompletionRequest) -> None:
    """The chat parameters that ask for what this server cannot do, refused by name."""
    if body.audio is not None or any(modality != "text" for modality in body.modalities or ()):
        raise APIError(400, "audio output is not supported: this server writes text (modalities [\"text\"])",
                       "audio" if body.audio is not None else "modalities")
    if body.web_search_options is not None:
        raise APIError(400, "web_search_options is not supported: this server does not search the web",
                       "web_search_options")
    for name in ("functions", "function_call"):
        if getattr(body, name) is not None:
            raise APIError(400, f"{name} is deprecated in OpenAI's API and not supported: send tools and "
                                f"tool_choice", name)


# -- a chat body, translated once ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatSettings:
    """What a chat body asks for, checked: the thinking switch, the tools to render and the dialect of the reply's
    calls, the sampling fields (SamplingParams' but max_tokens, which may depend on the prompt's length), and how
    the prompt is cut and its reply stopped."""
    thinking: bool
    tools: list | None
    dialect: Dialect | None
    sampling: dict
    max_tokens: int | None  # None: what max_model_len leaves after the prompt (as vLLM)
    keep_last: int | None  # truncate_prompt_tokens: keep the prompt's last this many tokens (None: all)
    stop: tuple[str, ...]


def parse_chat(raw: bytes, front) -> tuple[ChatCompletionRequest, ChatSettings]:
    """A chat request's body, parsed and translated once into what the server runs (front: streaming.Front, the
    model's name, vocabulary, family, limits and grammars). Every refusal here is the client's 4xx."""
    body = parse_body(raw, ChatCompletionRequest)
    return body, chat_settings(body, front)


def chat_settings(body: ChatCompletionRequest, front) -> ChatSettings:
    """The body's settings, checked (parse_chat's second half)."""
    check_common(body, front.model_name, front.vocab_size)
    check_chat_fields(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise InputError("top_logprobs needs logprobs=true")
    thinking = thinking_flag(body.chat_template_kwargs, body.reasoning_effort)
    tools, dialect, grammar = _chat_tools(front.family, body, thinking)
    json_grammar = _response_grammar(body, thinking)
    if grammar is not None and json_grammar is not None:
        raise InputError(f"response_format and tool_choice {body.tool_choice!r} cannot both hold the reply")
    grammar = grammar or json_grammar
    if grammar is not None:
        if front.grammars is None:
            raise InputError("this server has no constrained decoding")
        front.grammars.compile(grammar)  # a schema xgrammar cannot compile is the client's 400, found here
    sampling = sampling_fields(body, (body.top_logprobs or 0) if body.logprobs else None, front.vocab_size,
                               grammar=grammar)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return ChatSettings(thinking, tools, dialect, sampling, max_tokens, kept_tokens(body, front.max_model_len),
                        stop_strings(body))


def _chat_tools(family, body: ChatCompletionRequest,
                thinking: bool) -> tuple[list | None, Dialect | None, GrammarSpec | None]:
    """(tools to render, the dialect to parse the reply's calls with, the grammar tool_choice needs) from tools and
    tool_choice: "auto" (the default) lets the model choose; "required" and a named function hold the reply to a
    calls block of one call (of that function) by constrained decoding. parallel_tool_calls=false holds "auto" to
    text and at most one call; "required" and a named function make one call either way."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise InputError(f"tool_choice {choice!r} needs tools")
        return None, None, None
    if choice == "none":  # the model is not to call tools: they are left out of the prompt
        return None, None, None
    if choice not in (None, "auto", "required") and not isinstance(choice, dict):
        raise InputError(f"tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                         f"\"function\": {{\"name\": ...}}}}, got {choice!r}")
    dialect = family.tool_dialect
    if dialect is None:
        raise InputError(f"tools are not supported for {family.name}")
    check_tools(body.tools)
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in {tool.get("function", {}).get("name") for tool in body.tools if isinstance(tool, dict)}:
            raise InputError(f"tool_choice {choice!r} names no function of tools")
    if choice in (None, "auto") and body.parallel_tool_calls is not False:
        return body.tools, dialect, None
    return body.tools, dialect, tool_call_spec(dialect.structural_tag_model, body.tools, choice or "auto", thinking)


def _response_grammar(body: ChatCompletionRequest, thinking: bool) -> GrammarSpec | None:
    """response_format: "text" (none), "json_object" (any JSON object), "json_schema" ({"schema": ...})."""
    fmt = body.response_format
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return json_spec({"type": "object"}, thinking)
    if fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise InputError("response_format json_schema needs json_schema.schema, a JSON schema object")
        return json_spec(schema, thinking)
    raise InputError(f"response_format.type must be text, json_object or json_schema, got {fmt.get('type')!r}")
