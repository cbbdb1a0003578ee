"""`dsrun router`: one OpenAI-compatible endpoint in front of P/D-disaggregated `dsrun serve` instances
(runner/engine/kv_transfer.py says what P and D do).

Each chat or completion request goes first to a prefill instance (P) as the same body with max_tokens 1, no stream,
n 1 and `kv_transfer_params: {"do_remote_decode": true}`; P's response carries its hand-over in
`kv_transfer_params`, signed by P (engine/kv_auth.py), which the router passes on whole. Then the client's own body
goes to a decode instance (D) with those params, and D's reply, streamed or whole, is relayed to the client as it
comes: its status, its body, its errors. A batch completion (several prompts) gets one hand-over per prompt from P
(`{"prompts": [...]}`), and D gives each prompt its own. A request whose prompt must be scored (prompt_logprobs,
echo with logprobs) goes to D alone, which computes it; so does a request no P answers: a P that refuses the
connection or answers 5xx (503 while draining) is skipped for the next, and with none left D computes the prompt
itself (counted in dsrun:router_prefill_fallbacks). A P's 4xx (the client's mistake) is the client's answer. P is
picked by cached prefix and load: the instance that last served the request's prefix (the conversation before its
last message, or a completion prompt's start), unless it runs more than PREFIX_SLACK requests above the
least-loaded one; D by load (requests in flight through this router). An instance that refuses connections is
skipped for the request and tried again on the next; with no D answering the router answers 503 in OpenAI's error
shape.

At start the router asks every instance that answers for GET /v1/models and refuses to start unless they serve one
model name (clients name it, and P and D must serve the same model).

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models (a decode instance's), GET /health (200 when
a decode instance is healthy), GET /metrics (the router's own).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
from collections import OrderedDict
from dataclasses import dataclass

import httpx
import prometheus_client
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from dsconv.errors import InputError
from dsconv.runner.entrypoints.openai.protocol import APIError, load_body

PREFIX_SLACK = 2  # requests in flight a P may run above the least-loaded one and still get its cached prefix
PREFIX_KEYS = 4096  # prefixes remembered (least recently used forgotten)
PREFIX_CHARS = 1024  # of a completion prompt, the start that keys its P
HEALTH_TIMEOUT_S = 5.0
FORWARDED_HEADERS = ("authorization",)  # the client's API key goes on to the instances
PORTS = 65536
SERVER_ERROR = 500  # a P's status from here on is its own failure: the request goes on to another P, or D alone


@dataclass
class Backend:
    url: str
    role: str  # "prefill" | "decode"
    in_flight: int = 0


@dataclass(frozen=True)
class RouterOptions:
    prefill: list[str]
    decode: list[str]
    host: str
    port: int
    timeout: float


def main(o: RouterOptions) -> int:
    """Serves until SIGTERM or Ctrl-C -> 0."""
    import uvicorn

    if not o.decode:
        raise InputError("dsrun router needs at least one --decode URL")
    for url in [*o.prefill, *o.decode]:
        if not url.startswith(("http://", "https://")):
            raise InputError(f"{url!r} is not an http:// or https:// URL")
    if not 0 <= o.port < PORTS:
        raise InputError(f"--port {o.port} is not a port number")
    check_models([*o.prefill, *o.decode])
    server = uvicorn.Server(uvicorn.Config(create_app(o.prefill, o.decode, o.timeout), host=o.host, port=o.port,
                                           log_level="warning", lifespan="off", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, name="http", daemon=True)  # signals stay the main thread's
    thread.start()
    while not server.started:
        thread.join(timeout=0.05)
        if not thread.is_alive():
            raise InputError(f"cannot serve on {o.host}:{o.port} (is the port in use?)")
    port = server.servers[0].sockets[0].getsockname()[1]  # the one the OS chose for --port 0
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    print(f"dsrun router: on http://{o.host}:{port}, prefill {', '.join(o.prefill) or 'none'}, decode "
          f"{', '.join(o.decode)}", flush=True)
    try:
        while thread.is_alive():
            thread.join(timeout=0.5)
    except KeyboardInterrupt:
        server.should_exit = True
        thread.join()
    return 0


def check_models(urls: list[str]) -> None:
    """InputError (one line) unless every instance that answers GET /v1/models serves one model name; one that does
    not answer is skipped now and tried per request (DSRUN_API_KEY, when set, is the instances' --api-key)."""
    headers = {"Authorization": f"Bearer {os.environ['DSRUN_API_KEY']}"} if os.environ.get("DSRUN_API_KEY") else {}
    served: dict[str, str] = {}
    for url in urls:
        try:
            reply = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=HEALTH_TIMEOUT_S)
        except httpx.TransportError:
            continue
        if reply.status_code != 200:
            continue
        try:
            served[url] = ",".join(sorted(str(model["id"]) for model in reply.json()["data"]))
        except (ValueError, KeyError, TypeError):
            raise InputError(f"{url} answered GET /v1/models with no list of models: is it a dsrun serve (or "
                             f"another OpenAI-compatible) instance?") from None
    if len(set(served.values())) > 1:
        raise InputError("the instances serve different models (" + "; ".join(f"{url}: {name}" for url, name in
                         served.items()) + "): give every --prefill and --decode instance one --served-model-name")


class Router:
    """The instances, their loads as this router sees them, and the prefixes each P last served."""

    def __init__(self, prefill: list[str], decode: list[str], timeout: float):
        self.prefill = [Backend(url.rstrip("/"), "prefill") for url in prefill]
        self.decode = [Backend(url.rstrip("/"), "decode") for url in decode]
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=HEALTH_TIMEOUT_S))
        self.prefixes: OrderedDict[str, Backend] = OrderedDict()
        self.registry = prometheus_client.CollectorRegistry()
        self.requests = prometheus_client.Counter("dsrun:router_requests", "Requests sent to an instance, by outcome",
                                                  ["backend", "role", "outcome"], registry=self.registry)
        self.unrouted = prometheus_client.Counter("dsrun:router_unavailable", "Requests answered 503: no decode "
                                                  "instance answered", registry=self.registry)
        self.fallbacks = prometheus_client.Counter("dsrun:router_prefill_fallbacks", "Requests a decode instance "
                                                   "computed alone because no prefill instance answered",
                                                   registry=self.registry)

    def candidates(self, backends: list[Backend], key: str | None = None) -> list[Backend]:
        """The order to try them in: the least loaded first; with a prefix key, the instance that last served it
        first unless it runs more than PREFIX_SLACK above the least."""
        order = sorted(backends, key=lambda b: b.in_flight)
        held = self.prefixes.get(key) if key is not None else None
        if held is not None and order and held.in_flight <= order[0].in_flight + PREFIX_SLACK:
            order.remove(held)
            order.insert(0, held)
        return order

    def remember(self, key: str | None, backend: Backend) -> None:
        if key is None:
            return
        self.prefixes[key] = backend
        self.prefixes.move_to_end(key)
        while len(self.prefixes) > PREFIX_KEYS:
            self.prefixes.popitem(last=False)

    async def route(self, request: Request, path: str) -> Response:
        """A chat or completion request: P's hand-over, then D's reply (or D alone: `scores_prompt`)."""
        body = load_body(await request.body())  # a body no instance would take is refused here (400)
        if body.get("kv_transfer_params") is not None:
            raise APIError(400, "kv_transfer_params are the router's to set: send the request without them")
        headers = forwarded(request)
        if not scores_prompt(body):
            params = await self.prefill_params(path, body, headers)
            if isinstance(params, Response):
                return params
            if params is not None:
                body = {**body, "kv_transfer_params": params}
        return await self.decode_reply(path, body, headers)

    async def prefill_params(self, path: str, body: dict, headers: dict) -> dict | Response | None:
        """P's hand-over for the request -> its kv_transfer_params (one per prompt for a batch: `{"prompts": ...}`);
        P's own 4xx response; or None when no P answers (D then computes the prompt)."""
        key = prefix_key(body)
        sent = {**{k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")},
                "max_tokens": 1, "min_tokens": 0, "stream": False, "n": 1,
                "kv_transfer_params": {"do_remote_decode": True}}
        for backend in self.candidates(self.prefill, key):
            backend.in_flight += 1
            try:
                reply = await self.client.post(f"{backend.url}{path}", content=as_json(sent),
                                               headers={**headers, "content-type": "application/json"})
            except httpx.TransportError:
                self.requests.labels(backend.url, "prefill", "unreachable").inc()
                continue
            finally:
                backend.in_flight -= 1
            if reply.status_code >= SERVER_ERROR:
                self.requests.labels(backend.url, "prefill", "failed").inc()
                continue
            if reply.status_code != 200:
                self.requests.labels(backend.url, "prefill", "error").inc()
                return Response(reply.content, reply.status_code, media_type="application/json")
            self.requests.labels(backend.url, "prefill", "ok").inc()
            self.remember(key, backend)
            return {**reply.json()["kv_transfer_params"], "do_remote_prefill": True}  # P signed it: passed whole
        if self.prefill:
            self.fallbacks.inc()
        return None

    async def decode_reply(self, path: str, body: dict, headers: dict) -> Response:
        """D's reply to the request, relayed as it comes; 503 when no D answers."""
        for backend in self.candidates(self.decode):
            backend.in_flight += 1
            request = self.client.build_request("POST", f"{backend.url}{path}", content=as_json(body),
                                                headers={**headers, "content-type": "application/json"})
            try:
                reply = await self.client.send(request, stream=True)
            except httpx.TransportError:
                backend.in_flight -= 1
                self.requests.labels(backend.url, "decode", "unreachable").inc()
                continue
            self.requests.labels(backend.url, "decode", "ok" if reply.status_code == 200 else "error").inc()

            async def done(reply=reply, backend=backend) -> None:
                await reply.aclose()
                backend.in_flight -= 1

            return StreamingResponse(reply.aiter_raw(), reply.status_code,
                                     media_type=reply.headers.get("content-type"), background=BackgroundTask(done))
        self.unrouted.inc()
        raise APIError(503, "no decode instance answered: every --decode URL refused the connection")


def as_json(body: dict) -> bytes:
    """A body as the instances read it: ASCII JSON (every character escaped past ASCII, as the client may have)."""
    return json.dumps(body).encode()


def forwarded(request: Request) -> dict:
    """The client's headers that go on to the instances."""
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}


def prefix_key(body: dict) -> str | None:
    """What keys a request's cached prefix: a chat's conversation before its last message (or, for one message,
    that message), a completion prompt's start."""
    if isinstance(body.get("messages"), list) and body["messages"]:
        messages = body["messages"]
        prefix = messages[:-1] if len(messages) > 1 else messages
        text = json.dumps([body.get("cache_salt"), prefix], sort_keys=True, default=str)
    elif isinstance(body.get("prompt"), str):
        text = json.dumps([body.get("cache_salt"), body["prompt"][:PREFIX_CHARS]])
    else:
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def scores_prompt(body: dict) -> bool:
    """A request whose prompt must be computed where it is scored (its logprobs): no hand-over."""
    return body.get("prompt_logprobs") is not None or (bool(body.get("echo")) and body.get("logprobs") is not None)


def create_app(prefill: list[str], decode: list[str], timeout: float) -> FastAPI:
    router = Router(prefill, decode, timeout)
    app = FastAPI(title="dsrun router", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.route(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.route(request, "/v1/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = forwarded(request)
        for backend in router.candidates(router.decode):
            try:
                reply = await router.client.get(f"{backend.url}/v1/models", headers=headers)
            except httpx.TransportError:
                continue
            return Response(reply.content, reply.status_code, media_type="application/json")
        raise APIError(503, "no decode instance answered")

    @app.get("/health")
    async def health() -> Response:
        for backend in router.decode:
            try:
                if (await router.client.get(f"{backend.url}/health", timeout=HEALTH_TIMEOUT_S)).status_code == 200:
                    return JSONResponse({})
            except httpx.TransportError:
                continue
        raise APIError(503, "no decode instance is healthy")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(prometheus_client.generate_latest(router.registry),
                        media_type=prometheus_client.CONTENT_TYPE_LATEST)

    return app
