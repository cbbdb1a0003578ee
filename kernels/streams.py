"""A second stream for work that can run beside the main stream's: the shared expert beside the MoE's routed experts
and their exchange, V3.2's indexer prolog beside the MLA prolog (CANN's practice for V3.2 on Atlas A3 runs both
pairs on two streams).

On an accelerator `SideStream.beside()` puts what runs under it on a second stream that starts after an event
recorded on the main stream (so it sees every input the main stream has written), and `join()` makes the main stream
wait for an event recorded at its end. The host does not wait for either: both are stream-to-stream orderings.
torch.npu (torch_npu) and torch.cuda have the same calls for this: `Stream(device=)`, `Event()`, `Event.record(stream)`,
`Stream.wait_event(event)`, `current_stream(device)`, and the `stream(s)` context; the tests check these names and
signatures against torch_npu's wheel and torch.cuda.

On CPU there is no second stream: what runs under `beside()` runs in order, on the main thread. (The MoE's overlap on
CPU comes from gloo instead, whose asynchronous exchange runs on its own thread while the main thread computes.)

Memory: a tensor made on the side stream and freed after the join is returned to the side stream's pool by the
caching allocator; the side stream's next use of it starts after a later event of the main stream, which follows
every use the main stream made of it.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import ModuleType

import torch

from dsconv.kernels.device import require_torch_npu, takes_npu_path

# the stream and event calls this module makes, by object: what the API checks compare with torch_npu and torch.cuda
STREAM_API = {"module": ("Stream", "Event", "current_stream", "stream"), "Stream": ("wait_event",),
              "Event": ("record",)}


def stream_module(device: torch.device) -> ModuleType | None:
    """The module with `device`'s streams: torch_npu.npu for an NPU, torch.cuda for CUDA; None for the CPU."""
    if takes_npu_path(device):
        return require_torch_npu().npu
    if device.type == "cuda":
        return torch.cuda
    return None


class SideStream:
    """A second stream of `device` (None on CPU, where `beside` runs in order). `uses` counts the `beside` blocks run
    on a second stream, `joins` the joins that waited for one (what the tests read through the NPU contract double)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.module = stream_module(device)
        self.stream = None if self.module is None else self.module.Stream(device=device)
        self._done = None  # the event recorded at the end of the last `beside` block, not yet joined
        self.uses = self.joins = 0

    @property
    def parallel(self) -> bool:
        return self.stream is not None

    @contextmanager
    def beside(self):
        """Work under this block runs on the second stream, after the main stream's work so far."""
        if self.stream is None:
            yield
            return
        module = self.module
        main = module.current_stream(self.device)
        ready = module.Event()
        ready.record(main)
        self.stream.wait_event(ready)
        with module.stream(self.stream):
            yield
        self._done = module.Event()
        self._done.record(self.stream)
        self.uses += 1

    def join(self) -> None:
        """The main stream waits for the last `beside` block's work (nothing to do on CPU or when joined)."""
        if self._done is None:
            return
        self.module.current_stream(self.device).wait_event(self._done)
        self._done = None
        self.joins += 1
