"""`dsrun serve`'s HTTP front end on rank 0: an OpenAI-compatible API over the engine's door (runner/engine/core.py),
with what HTTP needs beside it (streaming.Front: the tokenizer, the chat format, the grammars, the model's name).

Routes: GET /health, GET /v1/models, POST /v1/completions (completions.py), POST /v1/chat/completions
(chat.py), POST /tokenize, POST /detokenize, GET /metrics, and a P/D producer's POST /kv_transfer/release (a
consumer's confirmation: engine/kv_transfer.py). Every error is answered in OpenAI's shape
{"error": {"message", "type", "param", "code"}} (protocol.APIError): 400 for a bad request (checked here, before the
engine sees it), 401 for a missing or wrong API key (--api-key), 404 for an unknown model or route, 503 while the
model loads or the server drains, 500 when the engine fails.
"""

from __future__ import annotations

import hmac
import time

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from dsconv.errors import InputError
from dsconv.runner.entrypoints.openai.chat import chat_completions, chat_prompt_ids
from dsconv.runner.entrypoints.openai.completions import completions, text_prompt
from dsconv.runner.entrypoints.openai.protocol import (APIError, CompletionRequest, DetokenizeRequest,
                                                       ReleaseRequest, TokenizeRequest, check_token_id,
                                                       model_not_found, parse_body, parse_chat,
                                                       thinking_flag)
from dsconv.runner.engine.kv_release import RELEASE_PATH
from dsconv.runner.engine.request import NotAccepting
from dsconv.runner.entrypoints.openai.streaming import Front


DP_RANK_HEADER = "X-DP-Rank"  # pins a request to one data-parallel rank (tests, debugging)
# With --api-key, the routes that need `Authorization: Bearer KEY` (vLLM's server guards the same ones); /health
# and /metrics stay open for load balancers and scrapers
KEYED_PREFIX, KEYED_PATHS = "/v1/", ("/tokenize", "/detokenize")


def create_app(engine: Front, metrics_registry: prometheus_client.CollectorRegistry,
               api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="dsrun serve", docs_url=None, redoc_url=None, openapi_url=None)
    started = int(time.time())
    _add_error_handlers(app)
    if api_key is not None:
        _require_api_key(app, api_key)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_ready():
            raise APIError(503, "the model is still loading")
        # the KV connectors' parts: KV offload's disk tier, "ok" or "disabled: why" (kv_offload_disk)
        return JSONResponse(engine.connector_health())

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": engine.model_name, "object": "model", "created": started, "owned_by": "dsconv",
             "max_model_len": engine.max_model_len}]})

    @app.post("/v1/completions")
    async def post_completions(request: Request) -> Response:
        body = parse_body(await read_body(request), CompletionRequest)
        _check_serving(engine)
        return await completions(engine, request, body, _dp_rank(request))

    @app.post("/v1/chat/completions")
    async def post_chat_completions(request: Request) -> Response:
        body, settings = parse_chat(await read_body(request), engine)
        _check_serving(engine)
        return await chat_completions(engine, request, body, settings, _dp_rank(request))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        ids = _tokenize(engine, parse_body(await read_body(request), TokenizeRequest))
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = parse_body(await read_body(request), DetokenizeRequest)
        _check_model(engine, body.model)
        for token_id in body.tokens:
            check_token_id(token_id, engine.vocab_size, "tokens")
        return JSONResponse({"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)})

    @app.post(RELEASE_PATH)
    async def release_transfer(request: Request) -> Response:
        body = parse_body(await read_body(request), ReleaseRequest)
        return JSONResponse({"held": engine.release_transfer(body.transfer_id)})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(prometheus_client.generate_latest(metrics_registry),
                        media_type=prometheus_client.CONTENT_TYPE_LATEST)

    return app


def _tokenize(engine: Front, body: TokenizeRequest) -> list[int]:
    """/tokenize: a conversation's prompt ids as a chat request renders them, or a text's (with BOS unless
    add_special_tokens is false)."""
    _check_model(engine, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InputError("give either prompt or messages")
    if body.messages is not None:
        return chat_prompt_ids(engine, body.messages, thinking_flag(body.chat_template_kwargs), body.tools)
    if body.chat_template_kwargs is not None or body.tools is not None:
        raise InputError("chat_template_kwargs and tools apply to messages only")
    if body.add_special_tokens:
        return text_prompt(engine, body.prompt).ids
    return engine.tokenizer.encode(body.prompt, add_special_tokens=False).ids  # the text's own tokens only


# The largest request body read: a prompt of V3's whole 163840-token context as JSON token ids is about 1.2 MB,
# lm-eval's batches of prompts a few MB; a larger body is refused (413) before it is held in memory.
MAX_BODY_BYTES = 32 * 2**20


async def read_body(request: Request) -> bytes:
    """The request's body, refused with a 413 once it (or its declared Content-Length) passes MAX_BODY_BYTES."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _too_large()
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large() -> APIError:
    return APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")


def _check_serving(engine: Front) -> None:
    if not engine.is_ready():
        raise APIError(503, "the model is still loading; try again when GET /health answers 200")
    if not engine.accepting():
        raise APIError(503, "the server is shutting down and takes no new requests")


def _check_model(engine: Front, model: str | None) -> None:
    if model is not None and model != engine.model_name:
        raise model_not_found(model, engine.model_name)


def _dp_rank(request: Request) -> int | None:
    value = request.headers.get(DP_RANK_HEADER)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise InputError(f"{DP_RANK_HEADER} must be an integer, got {value!r}") from None


def _require_api_key(app: FastAPI, api_key: str) -> None:
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        path = request.url.path
        if path.startswith(KEYED_PREFIX) or path in KEYED_PATHS:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):  # constant time: no timing hint of a key's prefix
                error = APIError(401, "a valid API key is required: send `Authorization: Bearer <key>`")
                return JSONResponse(error.body(), status_code=error.status)
        return await call_next(request)


def _add_error_handlers(app: FastAPI) -> None:
    def answer(error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return answer(exc)

    @app.exception_handler(InputError)  # SamplingParams, chat rendering and engine.submit refuse with these
    async def input_error(request: Request, exc: InputError) -> Response:
        return answer(APIError(400, str(exc)))

    @app.exception_handler(NotAccepting)  # submit's own check, when loading or draining began after ours
    async def not_accepting(request: Request, exc: NotAccepting) -> Response:
        return answer(APIError(503, str(exc)))

    @app.exception_handler(RequestValidationError)  # FastAPI's own parsing (422 by default); routes parse bodies
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return answer(APIError(400, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())))

    @app.exception_handler(HTTPException)  # unknown route (404), wrong method (405)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        return answer(APIError(500, f"{type(exc).__name__}: {exc}"))
