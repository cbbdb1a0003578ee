"""A KV connector written outside the engine, to show the seam (runner/engine/kv_connector/base.py) takes one without a
line changed in the scheduler, the worker or the loop: every published block a DP rank's pool gives up is saved into
a dict on its ranks (keyed by the block's hash), and a waiting request's prefix is served from that dict where the
device pool no longer has it. It records every call, in order. Caches without state blocks only (V3 / V3.2)."""

from __future__ import annotations

from dataclasses import dataclass

from dsconv.runner.engine.kv_connector.base import Events, KVConnector, KVConnectorWorker, StepMeta

SAVE, LOAD = "save", "load"


@dataclass(frozen=True)
class DictOps(StepMeta):
    """One step's copies on a DP index's ranks, in order: (SAVE, block, hash) into the dict, (LOAD, hash, block) out."""
    ops: tuple[tuple, ...]

    def validate(self, block_size: int, num_blocks: int) -> None:
        for op in self.ops:
            block = op[1] if op[0] == SAVE else op[2]
            if not 0 <= block < num_blocks:
                raise ValueError(f"invalid step batch: the dict connector copies block {block} of {num_blocks}")


class DictConnector(KVConnector):
    supplies_hits = True

    def __init__(self):
        self.calls: list[str] = []
        self.saved: set[bytes] = set()  # the hashes the ranks' dicts hold
        self.ops: dict[int, list[tuple]] = {}  # per DP rank, the next step's
        self.hit_tokens = 0  # served from the dict, in all

    def evicted(self, rank: int, kind: str, block: int, digest: bytes) -> None:
        self.calls.append("evicted")
        if digest not in self.saved:
            self.saved.add(digest)
            self.ops.setdefault(rank, []).append((SAVE, block, digest))

    def hit(self, request, rank, usable: list[bytes], blocks: list[int]) -> list[int] | None:
        self.calls.append("hit")
        if rank.states is not None:
            raise ValueError("the dict connector keeps no state blocks")
        pool, count = rank.blocks, 0
        while count < len(usable) and (usable[count] in pool.cached or usable[count] in self.saved):
            count += 1
        if count == len(blocks):
            return blocks
        device = [pool.cached.get(digest) for digest in usable[:count]]
        table = pool.adopt_with(request.seq_id, device)
        if table is None:  # no room for the copies now: the device's own hit
            return blocks
        for i, block in enumerate(device):
            if block is None:
                self.ops.setdefault(rank.index, []).append((LOAD, usable[i], table[i]))
                self.hit_tokens += rank.block_size
        pool.publish(request.seq_id, usable[:count])
        return table

    def step_meta(self, rank) -> DictOps | None:
        self.calls.append("step_meta")
        ops = self.ops.pop(rank.index, [])
        return DictOps(tuple(ops)) if ops else None

    def reported(self, reports: list, ranks) -> Events:
        self.calls.append("reported")
        return Events()

    def finished(self, request, rank) -> dict | None:
        self.calls.append("finished")
        return None

    def removed(self, request) -> None:
        self.calls.append("removed")

    def poll(self, now: float, ranks):
        self.calls.append("poll")
        return Events(), None


class DictWorker(KVConnectorWorker):
    """A rank's dict of saved blocks: each block's rows in every view of its cache (cache.transfer_views())."""

    def __init__(self, cache):
        self.views, _ = cache.transfer_views()
        self.store: dict[bytes, list] = {}

    def run(self, meta: DictOps) -> list:
        for op in meta.ops:
            if op[0] == SAVE:
                _, block, digest = op
                self.store[digest] = [view[block].clone() for view in self.views]
            else:
                _, digest, block = op
                for view, rows in zip(self.views, self.store[digest]):
                    view[block] = rows
        return [("dict", len(meta.ops))]
