"""The bridge between HTTP and the engine. `Front` is what the routes serve from: the engine's door and the model's
text side. A `RequestGroup` ties one HTTP request to its engine requests (one per prompt, each with the n samples
that are the prompt's choices): outputs arrive on the engine's thread and are handed to the event loop through a
queue (one wake-up of the loop per engine step, not one per output); a client that goes away, an error or a stop
string aborts what is still running, so its KV cache is freed. `close()` runs on every path out (the routes call it
in `finally`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import weakref
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dsconv.runner.entrypoints.openai.choice import Choice, EngineError
from dsconv.errors import InputError
from dsconv.family.text import TextTokenizer
from dsconv.runner.engine.kv_transfer import Offers
from dsconv.runner.engine.request import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from dsconv.runner.engine.core import EngineClient
    from dsconv.runner.engine.grammar import Grammars


CLIENT_GONE = 499  # nginx's status for "client closed request"; logged, never read


class Front:
    """What the routes serve from: the engine's door (submit, abort, readiness) and the model's text side."""

    def __init__(self, door: EngineClient, text: TextTokenizer, family, model_name: str, vocab_size: int,
                 max_model_len: int, grammars: Grammars | None):
        self.door, self.text, self.family, self.model_name = door, text, family, model_name
        self.vocab_size, self.grammars = vocab_size, grammars
        self._max_model_len = max_model_len  # until the engine is loaded (its cache may lower it)

    @property
    def tokenizer(self):
        return self.text.tokenizer

    @property
    def tokenizer_config(self) -> dict:
        return self.text.config

    @property
    def max_model_len(self) -> int:
        return self.door.max_model_len or self._max_model_len

    def is_ready(self) -> bool:
        return self.door.is_ready()

    def accepting(self) -> bool:
        return self.door.accepting()

    def connector_health(self) -> dict[str, str]:
        """What /health says of the engine's KV connectors (empty without one)."""
        return self.door.connector.health()

    def release_transfer(self, transfer_id: str) -> bool:
        """A P/D producer's lease ends (a consumer's POST) -> whether it was still held; its blocks go at the loop's
        next turn, which this wakes."""
        held = self.door.connector.release(transfer_id)
        self.door.wake()
        return held

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_output: Callable[[RequestOutput], None],
               dp_rank: int | None = None) -> str:
        return self.door.submit(prompt_ids, params, on_output, dp_rank)

    def abort(self, request_id: str, index: int | None = None) -> None:
        self.door.abort(request_id, index)


class LoopInbox:
    """Outputs handed from the engine's thread to one event loop. Waking a loop from another thread
    (call_soon_threadsafe) writes to its self-pipe, a system call taking the GIL from the engine: the first
    output of a step schedules one wake-up and the step's other outputs join it, so a step streaming to N
    requests wakes the loop once."""

    _by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopInbox]" = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[tuple[asyncio.Queue, object]] = []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "LoopInbox":
        """The loop's inbox (called on the loop's own thread, so never created twice)."""
        inbox = cls._by_loop.get(loop)
        if inbox is None:
            inbox = cls._by_loop[loop] = cls(loop)
        return inbox

    def post(self, queue: asyncio.Queue, item: object) -> None:
        """On any thread: item goes into queue on the loop's thread."""
        with self.lock:
            self.pending.append((queue, item))
            if len(self.pending) > 1:  # a wake-up is already scheduled and will take this item too
                return
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the event loop has shut down: nobody is waiting for these outputs any more
            pass

    def _deliver(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, []
        for queue, item in pending:
            queue.put_nowait(item)


class ClientGone(Exception):
    """The HTTP client disconnected while its requests were running."""


class RequestGroup:
    """The engine requests of one HTTP request (one per prompt), and the queue their outputs reach the event loop
    through; each sample of each request is one choice."""

    def __init__(self, engine: Front, request: Request, dp_rank: int | None):
        self.engine = engine
        self.dp_rank = dp_rank
        self.inbox = LoopInbox.of(asyncio.get_running_loop())
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self.running: set[tuple[str, int]] = set()  # (request id, sample) submitted, not finished, not aborted
        self.disconnected = asyncio.ensure_future(_wait_for_disconnect(request))

    def submit(self, index: int, prompt_ids: list[int], params: SamplingParams) -> str:
        """Its samples are choices index .. index + params.n - 1."""
        def on_output(out: RequestOutput) -> None:  # on the engine's thread
            self.inbox.post(self.queue, (index + out.index, out))

        request_id = self.engine.submit(prompt_ids, params, on_output, dp_rank=self.dp_rank)
        self.running.update((request_id, sample) for sample in range(params.n))
        return request_id

    async def next(self) -> tuple[int, RequestOutput]:
        """The next output of any of the requests (choice index, output); raises ClientGone on a disconnect."""
        if self.disconnected.done():
            raise ClientGone()
        if self.queue.empty():  # wait for an output or the disconnect, whichever comes first
            get = asyncio.ensure_future(self.queue.get())
            try:
                await asyncio.wait((get, self.disconnected), return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not get.done():
                    get.cancel()
            if not get.done() or get.cancelled():
                raise ClientGone()
            index, out = get.result()
        else:  # already here (a step's outputs arrive together): no task, no wait
            index, out = self.queue.get_nowait()
        if out.finished:
            self.running.discard((out.request_id, out.index))
        return index, out

    def abort(self, request_id: str, sample: int) -> None:
        if (request_id, sample) in self.running:
            self.running.discard((request_id, sample))
            self.engine.abort(request_id, sample)

    def close(self) -> None:
        self.disconnected.cancel()
        for request_id in {request_id for request_id, _ in self.running}:
            self.engine.abort(request_id)
        self.running.clear()


async def _wait_for_disconnect(request: Request) -> None:
    # After the body has been read, the next ASGI message of an HTTP request is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def updates(requests: RequestGroup, choices: list[Choice]) -> AsyncIterator[Choice]:
    """Feeds each engine output to its choice and yields the choice, until every choice is done. A choice a stop
    string ended has its engine request aborted; outputs still in flight for it are dropped."""
    while not all(choice.done for choice in choices):
        index, out = await requests.next()
        choice = choices[index]
        if choice.done:
            continue
        choice.consume(out)
        if choice.stopped_here:
            requests.abort(choice.request_id, choice.sample)
        yield choice


def prompt_params(params: SamplingParams, k: int, prompts: int) -> SamplingParams:
    """Prompt k's params: for a P/D consumer's batch, its own producer's offer (kv_transfer.Offers)."""
    if not isinstance(params.kv_transfer, Offers):
        return params
    if len(params.kv_transfer.each) != prompts:
        raise InputError(f"kv_transfer_params holds {len(params.kv_transfer.each)} offers for {prompts} prompts: "
                         f"one per prompt")
    return dataclasses.replace(params, kv_transfer=params.kv_transfer.each[k])


async def answer(requests: RequestGroup, response, choices: list[Choice], stream: bool,
                 params: SamplingParams) -> Response:
    """Submits each prompt once for its params.n choices (in order, sample 0 first), then returns the SSE stream
    or, once every choice is done, the whole response (response: the route's Completion or ChatCompletion:
    `chunks`, `response`). The requests are closed on every path out: by the stream when it ends, else here."""
    made = None
    try:
        firsts = choices[::params.n]
        for k, first in enumerate(firsts):
            request_id = requests.submit(first.index, first.prompt_ids, prompt_params(params, k, len(firsts)))
            for choice in choices[first.index:first.index + params.n]:
                choice.request_id = request_id
        if stream:
            made = EventStream(sse_events(response.chunks(requests)), requests)
            return made
        async for _ in updates(requests, choices):
            pass
        return JSONResponse(response.response())
    except EngineError as exc:
        raise exc.api_error() from None
    except ClientGone:
        return Response(status_code=CLIENT_GONE)
    finally:
        if made is None:
            requests.close()


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


DONE = sse("[DONE]")


async def sse_events(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """A streamed response's events: each chunk, then `data: [DONE]`. An engine error midway becomes an error
    event in OpenAI's shape before [DONE] (the openai client raises on it); a client that has gone gets nothing
    more."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except ClientGone:
        return
    except EngineError as exc:
        yield sse(exc.api_error().body())
    yield DONE


class EventStream(StreamingResponse):
    """A server-sent-event stream that closes its engine requests however the response ends: the client going
    away may cancel the body iterator before it starts, where its own `finally` would never run."""

    def __init__(self, events: AsyncIterator[str], requests: RequestGroup):
        super().__init__(events, media_type="text/event-stream")
        self.requests = requests

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.requests.close()
