"""The OpenAI-compatible request bodies `dsrun serve` accepts, parsed strictly at the edge: a wrong type, an
unknown field or an unsupported option is a 400 that names it, before anything reaches the engine."""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from dsconv.errors import InputError
from dsconv.runner.engine.grammar import GrammarSpec
from dsconv.runner.engine.request import SamplingParams

SEED_LIMIT = 2**63  # seeds are int64, as in OpenAI's API
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat defaults to what the context leaves)
DEFAULT_TEMPERATURE = 1.0  # OpenAI's and vLLM's default; SamplingParams' own default (greedy) is for dsrun generate
THINKING_KEYS = ("thinking", "enable_thinking")  # DeepSeek-V3.1's template reads the first, Qwen's the second

# OpenAI SDKs map these names to exception classes
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "code"}}."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status

    def body(self) -> dict:
        error_type = ERROR_TYPES.get(self.status) or HTTPStatus(self.status).phrase.replace(" ", "") + "Error"
        return {"error": {"message": str(self), "type": error_type, "param": None, "code": self.status}}


class _Body(BaseModel):
    # strict: "16" is not a number and true is not 1; unknown fields are refused rather than ignored
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


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
    user: str | None = None  # accepted and ignored, as by OpenAI's API for abuse tracking
    return_tokens_as_token_ids: bool = False  # vLLM's extension: logprob tokens as "token_id:<id>"


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[Any]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None  # OpenAI function schemas: [{"type": "function", "function": {...}}]
    tool_choice: str | dict[str, Any] | None = None  # "none", "auto" (the default with tools), "required", a name
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


Body = TypeVar("Body", bound=_Body)


def parse_body(raw: bytes, model: type[Body]) -> Body:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise APIError(400, describe(exc)) from None


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
        raise APIError(404, f"The model `{body.model}` does not exist; this server serves `{model_name}`.")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0.0):
            raise InputError(f"{name}={getattr(body, name)} is not supported: only 0")
    if body.stream_options is not None and not body.stream:
        raise InputError("stream_options is only allowed with stream=true")
    if body.top_k is not None and body.top_k < -1:
        raise InputError(f"top_k must be -1 or 0 (off) or positive, got {body.top_k}")
    if body.seed is not None and not -SEED_LIMIT <= body.seed < SEED_LIMIT:
        raise InputError(f"seed must be a 64-bit signed integer, got {body.seed}")
    if any(not stop for stop in stop_strings(body)):
        raise InputError("stop strings must not be empty")
    for token_id in body.stop_token_ids or ():
        check_token_id(token_id, vocab_size, "stop_token_ids")


def stop_strings(body: _Sampling) -> tuple[str, ...]:
    if body.stop is None:
        return ()
    return (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)


def check_token_id(token_id: int, vocab_size: int, where: str) -> None:
    if not 0 <= token_id < vocab_size:
        raise InputError(f"{where} holds token id {token_id}, outside the vocabulary [0, {vocab_size})")


def sampling_params(body: _Sampling, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None, grammar: GrammarSpec | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
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
    )


def thinking_flag(kwargs: dict[str, Any] | None) -> bool:
    """chat_template_kwargs' thinking switch (off by default); other template kwargs are refused, not ignored."""
    kwargs = kwargs or {}
    unknown = sorted(set(kwargs) - set(THINKING_KEYS))
    if unknown:
        raise InputError(f"chat_template_kwargs {', '.join(map(repr, unknown))} not supported; "
                         f"only {' / '.join(THINKING_KEYS)}")
    values = {key: kwargs[key] for key in THINKING_KEYS if key in kwargs}
    for key, value in values.items():
        if not isinstance(value, bool):
            raise InputError(f"chat_template_kwargs.{key} must be true or false, got {value!r}")
    if len(set(values.values())) > 1:
        raise InputError("chat_template_kwargs.thinking and enable_thinking disagree")
    return next(iter(values.values()), False)


def chat_messages(messages: list[Any]) -> list[Any]:
    """OpenAI's content-part lists ([{"type": "text", "text": ...}]) joined into one text, as vLLM joins them;
    everything else goes to family/chat.py's checks unchanged."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InputError(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                                     f"are supported, got {part!r:.80}")
                texts.append(part["text"])
            message = {**message, "content": "\n".join(texts)}
        out.append(message)
    return out
