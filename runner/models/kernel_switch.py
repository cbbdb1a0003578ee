"""--kernels torch|pypto: which kernels a step's hot parts run.

`torch` (the default) runs every layer in torch (and torch_npu on an NPU). `pypto` runs the decode steps' hot parts
through the PyPTO kernels of kernels/pypto/, each called where the torch path would compute the same values:
- V3 / V3.2: the RMSNorm with the residual add after attention, the lightning indexer's scores and top-k, the
  absorbed sparse MLA attention over the latent cache, the MoE gate, and the W8A8 routed experts' grouped MLP;
- V4: the decode attention over the window and the compressed entries with its sinks, and the MoE gate (its hash
  layers too).
Everything else, every collective (gloo / HCCL) and every prefill step stays torch. Without an NPU the kernels run
through PyPTO's interpreter on the host (kernels/pypto/host.py): seconds a call, for checking, not for speed.
Compiled kernels on an NPU (CANN) are not built yet: `--kernels pypto --device npu` is refused.

A decode step is one where every sequence feeds one token (no prefill chunk, no speculative verification).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

KERNELS = ("torch", "pypto")


@dataclass
class KernelSwitch:
    name: str = "torch"
    on: bool = False  # this step runs the PyPTO kernels (`start`)

    def calls(self) -> dict[str, int]:
        """This process's PyPTO kernel calls by kernel name (empty under `torch`)."""
        if self.name != "pypto":
            return {}
        from dsconv.kernels.pypto.host import CALLS

        return dict(CALLS)

    @contextmanager
    def step(self, seqs: list, context_parallel: bool = False):
        """Around a step's forward: on for a `pypto` run's decode steps (seqs: the step's SeqSteps), the kernels'
        verify tables checked when the step ends (kernels/pypto/host.py, deferred_checks)."""
        self.on = (self.name == "pypto" and not context_parallel and bool(seqs)
                   and all(seq.query_len == 1 for seq in seqs))
        if not self.on:
            yield
            return
        from dsconv.kernels.pypto.host import deferred_checks

        try:
            with deferred_checks():
                yield
        finally:
            self.on = False
