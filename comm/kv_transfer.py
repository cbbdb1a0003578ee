"""One rank's Mooncake transfer engine: its KV cache registered for peers to read, and reads from a peer's.

The Mooncake transfer engine (PyPI `mooncake-transfer-engine-non-cuda`; `-npu` on Ascend) moves registered memory
between processes. A rank initializes it with a peer-to-peer handshake and no metadata server
(`initialize(host, "P2PHANDSHAKE", "tcp", "")`), after which peers name it by its session, `host:rpc_port`. The
non-CUDA wheel loads the system library `libibverbs.so.1` when imported, even for TCP (Debian's `libibverbs1`);
where RDMA devices exist, `MC_FORCE_TCP=true` keeps it on TCP. `batch_transfer_sync_read(session, local addresses,
peer addresses, lengths)` copies from the peer's registered memory into ours and returns 0, or a negative code on
failure. A peer that is gone fails at once; one that accepts the connection and never answers holds the call for
the engine's own handshake timeout (about a minute), which is why a read here runs in a thread of its own that the
caller waits for at most `timeout` seconds.

A read lands in a staging buffer registered for that read alone, and only a read that completed in time is copied
into the cache: a read given up on can finish later without touching blocks that have since been given to another
sequence.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass

import torch

# glog's level for the engine's own log lines (0: info .. 2: error): warnings and info lines stay quiet unless
# the user sets it
os.environ.setdefault("GLOG_minloglevel", "2")
PROTOCOL = "tcp"  # the transport this runs on: TCP between hosts (RDMA devices, when present, are bypassed)
HANDSHAKE = "P2PHANDSHAKE"  # peers exchange their segments' descriptions directly: no metadata server


class TransferError(RuntimeError):
    """A transfer that did not complete: the peer is gone, refused it, or took longer than allowed."""


def engine_class():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransferError(f"the Mooncake transfer engine cannot be imported ({exc}): install dsconv's [pd] extra "
                            f"(mooncake-transfer-engine-non-cuda; -npu on Ascend) and the system library "
                            f"libibverbs.so.1 (Debian: apt-get install libibverbs1)") from None
    return TransferEngine


@dataclass(frozen=True)
class Region:
    """One run of registered memory a peer reads from, cut in equal units (a cache block's bytes of one tensor):
    unit i is at address + i * unit_bytes."""
    address: int
    unit_bytes: int
    units: int


class TransferAgent:
    """This rank's transfer engine: `publish` registers the cache's regions for peers to read; `read` copies units
    of a peer's regions into this rank's."""

    def __init__(self, host: str):
        self.host = host
        self.engine = engine_class()()
        if self.engine.initialize(host, HANDSHAKE, PROTOCOL, "") != 0:
            raise TransferError(f"the Mooncake transfer engine did not start on {host} ({PROTOCOL})")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._pinned: list[torch.Tensor] = []  # what is registered stays alive as long as the agent

    def publish(self, views: list[torch.Tensor]) -> list[Region]:
        """Registers each [units, unit_bytes] uint8 view (of the cache's storage) -> their regions, in order."""
        regions = []
        for view in views:
            if self.engine.register_memory(view.data_ptr(), view.nbytes) != 0:
                raise TransferError(f"registering {view.nbytes} bytes with the transfer engine failed")
            self._pinned.append(view)
            regions.append(Region(view.data_ptr(), view.shape[1], view.shape[0]))
        return regions

    def read(self, session: str, sources: list[tuple[Region, list[int]]], timeout: float) -> torch.Tensor:
        """Units of a peer's regions -> one uint8 tensor of them, in order (sources: (peer region, its units)).
        Raises TransferError when the read fails or takes longer than `timeout` seconds."""
        lengths = [region.unit_bytes for region, units in sources for _ in units]
        staging = torch.empty(sum(lengths), dtype=torch.uint8)
        if not lengths:
            return staging
        addresses = [region.address + unit * region.unit_bytes for region, units in sources for unit in units]
        offsets = [staging.data_ptr() + start for start in itertools.accumulate([0, *lengths[:-1]])]
        outcome: list[int] = []
        done = threading.Event()

        def run() -> None:  # keeps `staging` registered and alive until the engine lets go of it
            try:
                if self.engine.register_memory(staging.data_ptr(), staging.nbytes) != 0:
                    outcome.append(-1)
                    return
                outcome.append(self.engine.batch_transfer_sync_read(session, offsets, addresses, lengths))
                self.engine.unregister_memory(staging.data_ptr())
            finally:
                done.set()

        threading.Thread(target=run, name="kv-transfer-read", daemon=True).start()
        started = time.perf_counter()
        if not done.wait(timeout):
            raise TransferError(f"reading {staging.nbytes} bytes from {session} took longer than {timeout:g} s")
        if outcome != [0]:
            raise TransferError(f"reading {staging.nbytes} bytes from {session} failed (transfer engine code "
                                f"{outcome[0] if outcome else 'none'}, after {time.perf_counter() - started:.3f} s): "
                                f"the peer is gone or refused it")
        return staging
