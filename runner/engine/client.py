"""Rank 0's engine front: requests come in from any thread (the HTTP server's, or `dsrun generate`'s list of
prompts) and the engine loop runs in rank 0's main thread, the only one that enters collectives.

`submit` checks a request against what never changes (vocabulary, lengths, cache size) and answers at once;
the loop picks it up before its next step and places it on a DP rank. Outputs go to each request's callback
from the loop's thread.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import uuid
from typing import Callable

from dsconv.runner.engine.core import EngineCore
from dsconv.runner.engine.request import NotAccepting, RequestOutput, SamplingParams, check_prompt


class EngineClient:
    def __init__(self, core: EngineCore | None, vocab_size: int, max_model_len: int, keepalive_s: float | None = None,
                 drain_timeout_s: float = 30.0, model_name: str = "", tokenizer=None, family=None,
                 tokenizer_config: dict | None = None, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, grammars=None):
        self.core = core
        self.grammars = grammars  # engine.grammar.Grammars: constrained decoding (None: requests may not ask for it)
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.model_name, self.tokenizer, self.family = model_name, tokenizer, family
        self.tokenizer_config = tokenizer_config or {}
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.keepalive_s, self.drain_timeout_s = keepalive_s, drain_timeout_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ready, self._draining = threading.Event(), threading.Event()

    # -- any thread ------------------------------------------------------------------------------------------

    def is_ready(self) -> bool:
        return self._ready.is_set() and not self._draining.is_set()

    def accepting(self) -> bool:
        return not self._draining.is_set()

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_output: Callable[[RequestOutput], None],
               dp_rank: int | None = None) -> str:
        if not self.accepting():
            raise NotAccepting("the server is shutting down")
        if not self._ready.is_set():
            raise NotAccepting("the model is still loading")
        check_prompt(prompt_ids, params.max_tokens, self.vocab_size, self.max_model_len)
        self.core.scheduler.check(len(prompt_ids), params, dp_rank)
        request_id = uuid.uuid4().hex
        self._commands.put(("add", request_id, list(prompt_ids), params, on_output, dp_rank))
        return request_id

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Ends sample `index` of the request, or all of its samples."""
        self._commands.put(("abort", request_id, index))

    def drain(self) -> None:
        """Stop admitting; the loop finishes what is in flight (aborting it after drain_timeout_s) and ends."""
        self._draining.set()
        self._commands.put(("wake",))

    # -- rank 0's main thread --------------------------------------------------------------------------------

    def attach(self, core: EngineCore) -> None:
        """The engine, once the model is loaded (the front end answers before, with 503)."""
        self.core = core

    def set_ready(self) -> None:
        self._ready.set()

    def run(self, until_idle: bool = False) -> None:
        """The engine loop: until drained, or (until_idle) until every submitted request has finished. A loop that
        waits for requests (not until_idle) sends a keep-alive every keepalive_s while idle."""
        scheduler, deadline = self.core.scheduler, None
        try:
            while True:
                self._apply_pending()
                if self._draining.is_set():
                    deadline = deadline or time.monotonic() + self.drain_timeout_s
                    if time.monotonic() > deadline:
                        for request_id, index in list(scheduler.requests):
                            self._apply(("abort", request_id, index))
                    if not scheduler.has_work:
                        return
                if not scheduler.has_work:
                    if until_idle:
                        return
                    try:  # idle: no collectives until a request comes, a keep-alive before any could time out
                        self._apply(self._commands.get(timeout=self.keepalive_s))
                    except queue.Empty:
                        self.core.keepalive()
                    continue
                for request, out in self.core.step():
                    _deliver(request.on_output, out)
        finally:
            self.core.stop()

    def _apply_pending(self) -> None:
        while True:
            try:
                self._apply(self._commands.get_nowait())
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        self._apply_one(command)
        self.core.record_queues()

    def _apply_one(self, command: tuple) -> None:
        kind, *args = command
        if kind == "add":
            request_id, prompt, params, on_output, dp_rank = args
            if self._draining.is_set():
                for index in range(params.n):
                    _deliver(on_output, RequestOutput(request_id, len(prompt), index=index, finished=True,
                                                      finish_reason="abort", error="the server is shutting down",
                                                      unavailable=True))
                return
            self.core.scheduler.add(request_id, prompt, params, on_output, dp_rank)
        elif kind == "abort":
            for request, out in self.core.scheduler.abort(*args):
                _deliver(request.on_output, out)


def _deliver(on_output, out: RequestOutput) -> None:
    try:
        on_output(out)
    except Exception as exc:  # noqa: BLE001  (one client's broken callback must not stop the engine)
        print(f"dsrun: dropping an output of request {out.request_id}: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
