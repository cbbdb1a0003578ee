"""Connectors combined (vLLM's MultiConnector): a list on each side, in the order their work runs on a rank (KV
offload's copies before a P/D consumer's reads). A step's Batch carries one entry per connector (`MultiMeta`); the
ranks' reports go to every connector, each taking its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from dsconv.runner.engine.kv_connector.base import Events, KVConnector, KVConnectorWorker, StepMeta

T = TypeVar("T")


@dataclass(frozen=True)
class MultiMeta(StepMeta):
    """One step's work of every connector of the list, in its order (None where one has none)."""
    each: tuple[StepMeta | None, ...]

    def validate(self, block_size: int, num_blocks: int) -> None:
        for meta in self.each:
            if meta is not None:
                meta.validate(block_size, num_blocks)


class MultiConnector(KVConnector):
    def __init__(self, connectors: list[KVConnector]):
        self.connectors = connectors
        handoffs = [c for c in connectors if c.takes_handoffs]
        if len(handoffs) > 1:
            raise ValueError("at most one connector of a list may take kv_transfer_params")
        self._checker = handoffs[0] if handoffs else KVConnector()

    def find(self, kind: type[T]) -> T | None:
        return next((found for c in self.connectors if (found := c.find(kind)) is not None), None)

    def check(self, prompt_ids, params, block_size) -> None:
        self._checker.check(prompt_ids, params, block_size)

    def take(self, request, rank) -> bool:
        return any(c.take(request, rank) for c in self.connectors)  # the first that takes it holds it

    def rejected(self, params) -> None:
        for c in self.connectors:
            c.rejected(params)

    def hit(self, request, rank, usable, blocks):
        """The first connector that supplies hits answers (its hit covers the device's own)."""
        for c in self.connectors:
            if c.supplies_hits:
                return c.hit(request, rank, usable, blocks)
        return rank.with_state(request, blocks)

    def evicted(self, rank, kind, block, digest) -> None:
        for c in self.connectors:
            c.evicted(rank, kind, block, digest)

    def step_meta(self, rank) -> MultiMeta | None:
        each = tuple(c.step_meta(rank) for c in self.connectors)
        return None if all(meta is None for meta in each) else MultiMeta(each)

    @property
    def has_step_work(self) -> bool:
        return any(c.has_step_work for c in self.connectors)

    def reported(self, reports, ranks) -> Events:
        events = Events()
        for c in self.connectors:
            events.add(c.reported(reports, ranks))
        return events

    def finished(self, request, rank) -> dict | None:
        return next((params for c in self.connectors if (params := c.finished(request, rank)) is not None), None)

    def removed(self, request) -> None:
        for c in self.connectors:
            c.removed(request)

    def poll(self, now, ranks):
        events, wait = Events(), None
        for c in self.connectors:
            more, after = c.poll(now, ranks)
            events.add(more)
            wait = after if wait is None else (wait if after is None else min(wait, after))
        return events, wait

    @property
    def holding(self) -> bool:
        return any(c.holding for c in self.connectors)

    def release(self, transfer_id: str) -> bool:
        return any(c.release(transfer_id) for c in self.connectors)

    def stop(self):
        each = [c.stop() for c in self.connectors]
        indices = sorted({index for metas in each if metas for index in metas})
        return {index: MultiMeta(tuple((metas or {}).get(index) for metas in each)) for index in indices} or None

    def health(self) -> dict[str, str]:
        return {key: value for c in self.connectors for key, value in c.health().items()}

    def summary(self) -> str:
        return "; ".join(part for c in self.connectors if (part := c.summary()))


class MultiConnectorWorker(KVConnectorWorker):
    def __init__(self, workers: list[KVConnectorWorker]):
        self.workers = workers

    def run(self, meta: MultiMeta) -> list:
        _check_meta(meta, len(self.workers))
        return [report for worker, one in zip(self.workers, meta.each) if one is not None
                for report in worker.run(one)]

    def finish(self, meta: MultiMeta | None) -> None:
        if meta is not None:
            _check_meta(meta, len(self.workers))
        for i, worker in enumerate(self.workers):
            worker.finish(None if meta is None else meta.each[i])


def _check_meta(meta, count: int) -> None:
    if not isinstance(meta, MultiMeta) or len(meta.each) != count:
        raise ValueError(f"invalid step batch: work for {len(getattr(meta, 'each', ()))} KV connectors on a rank "
                         f"with {count}")
