"""The engine's door on rank 0: requests come in from any thread (the HTTP server's, or `dsrun generate`'s list of
prompts) and wait on a queue for the loop (core.EngineCore.run), which runs in rank 0's main thread, the only one
that enters collectives.

`submit` checks a request against what never changes (vocabulary, lengths, cache size) and answers at once; the
loop picks it up before its next step and places it on a DP rank. Outputs go to each request's callback from the
loop's thread. The door exists before the engine does (a server answers 503 while the model loads); the engine
opens it once loaded.
"""

from __future__ import annotations

import queue
import threading
import uuid
from typing import TYPE_CHECKING, Callable, Iterator

from dsconv.runner.engine.request import NotAccepting, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from dsconv.runner.engine.core import EngineCore


class EngineClient:
    def __init__(self):
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ready, self._draining = threading.Event(), threading.Event()
        self._check = None  # the engine's admission check, once open
        self.max_model_len: int | None = None  # the engine's, once open

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
        self._check(prompt_ids, params, dp_rank)
        request_id = uuid.uuid4().hex
        self._commands.put(("add", request_id, list(prompt_ids), params, on_output, dp_rank))
        return request_id

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Ends sample `index` of the request, or all of its samples."""
        self._commands.put(("abort", request_id, index))

    def drain(self) -> None:
        """Stop admitting; the loop finishes what is in flight (aborting it after its drain timeout) and ends."""
        self._draining.set()
        self._commands.put(("wake",))

    # -- the engine's side -----------------------------------------------------------------------------------

    def open(self, engine: EngineCore) -> None:
        """Admit requests to `engine` (rank 0's, loaded)."""
        self._check, self.max_model_len = engine.check, engine.max_model_len
        self._ready.set()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def pending(self) -> Iterator[tuple]:
        """The commands waiting now, oldest first."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def next_command(self, timeout: float | None) -> tuple:
        """The next command, waiting up to `timeout` seconds (queue.Empty after that)."""
        return self._commands.get(timeout=timeout)
