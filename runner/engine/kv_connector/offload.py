"""KV offload as a connector (engine/kv_offload.py says what the host and disk tiers are): on rank 0 one Offloader per
DP rank, told of every block its pool gives up (`evicted`), answering a waiting request's prefix through the tiers
(`hit`) and sending each step's copies to the ranks (`step_meta`); on every rank the OffloadStore that runs them."""

from __future__ import annotations

from dsconv.runner.engine.kv_connector.base import Events, KVConnector, KVConnectorWorker
from dsconv.runner.engine.kv_offload import (BLOCK, STATE, OffloadConfig, OffloadCounts, Offloader, OffloadOps,
                                             OffloadReport, TierShape)
from dsconv.runner.engine.offload_store import OffloadStore
from dsconv.runner.models.kv_cache import Restore


class OffloadConnector(KVConnector):
    supplies_hits = True

    def __init__(self, config: OffloadConfig, shape: TierShape, disk_found: list[tuple[dict, dict]] | None, dp: int):
        """disk_found: per DP index, per kind the hashes every rank of it has a file for, oldest first, and those
        only some have (offload_store.agree; None: no disk tier)."""
        self.config, self.shape, self.counts = config, shape, OffloadCounts()
        known, strays = zip(*disk_found) if disk_found is not None else ([None] * dp, [None] * dp)
        self.offloaders = [Offloader(shape, known[rank], self.counts, strays[rank]) for rank in range(dp)]

    def evicted(self, rank: int, kind: str, block: int, digest: bytes) -> None:
        self.offloaders[rank].evicted(kind, block, digest)

    def step_meta(self, rank) -> OffloadOps | None:
        """Every eviction and hit of the step being built, copied before it runs."""
        return self.offloaders[rank.index].take_ops()

    def reported(self, reports: list, ranks) -> Events:
        """Before the step's results are taken: what failed to read is no hit for anyone."""
        for report in reports:
            if isinstance(report, OffloadReport):
                self.offloaders[report.dp_index].reported(report)
        for offloader in self.offloaders:
            offloader.settled()
        return Events()

    def stop(self) -> dict[int, OffloadOps] | None:
        """Per DP index, the ops that write its host tier's blocks to disk (Offloader.flush)."""
        flush = {index: ops for index, offloader in enumerate(self.offloaders) if (ops := offloader.flush())}
        return flush or None

    def health(self) -> dict[str, str]:
        """The disk tier: "ok", or "disabled: why" once a filesystem error stopped its writes."""
        if self.offloaders[0].disk is None:
            return {}
        stopped = self.counts.disk_stopped
        return {"kv_offload_disk": "ok" if stopped is None else f"disabled: {stopped}"}

    def summary(self) -> str:
        return self.shape.summary(self.config)

    def hit(self, request, rank, usable: list[bytes], blocks: list[int]) -> list[int] | None:
        """The device pool's hit (`blocks`, of the prompt's usable hashes) extended through the host and disk tiers,
        cut back (DeepSeek-V4) to the longest boundary whose state blocks some tier holds -> the hit's blocks, the
        request's table started with them: the host tier's copied into fresh blocks by this step's ops. None when
        part of it is on disk: its reads go out with this step, and the request waits for them (or while another
        request's reads of it are unchecked)."""
        offloader, pool, states = self.offloaders[rank.index], rank.blocks, rank.states
        where = [self._tier(rank, BLOCK, digest) for digest in usable]
        count, needed, state_where = self._boundary(rank, usable, where)
        if any(w == "pending" for _, _, w in needed):
            return None
        on_disk = [(kind, usable[i]) for kind, i, w in needed if w == "disk"]
        if on_disk:  # read into host slots by this step; the hit's host entries kept there meanwhile
            self._hold_host(offloader, needed, usable)
            if not offloader.fetch(on_disk):
                return self._device_hit(rank, request, blocks)  # no host slot free for them now
            return None
        host_states = [i for i, w in state_where.items() if w == "host"]
        if states is not None and len(host_states) > states.num_free:
            return self._device_hit(rank, request, blocks)
        self._hold_host(offloader, needed, usable)  # before the blocks the copies go to are taken
        table = pool.adopt_with(request.seq_id, [pool.cached[usable[i]] if where[i] == "device" else None
                                                 for i in range(count)])
        if table is None:  # no room for the copies
            return self._device_hit(rank, request, blocks)
        for i in range(count):
            found = where[i] if where[i] == "device" else offloader.load(BLOCK, usable[i], table[i])
            self.counts.hit_tokens[found] += rank.block_size
        pool.publish(request.seq_id, usable[:count])
        if states is not None and count:
            self._restore(rank, request, usable, state_where, host_states, count)
        return table

    def _tier(self, rank, kind: str, digest: bytes) -> str | None:
        device = rank.blocks.cached if kind == BLOCK else rank.states.cached
        return "device" if digest in device else self.offloaders[rank.index].where(kind, digest)

    def _boundary(self, rank, usable: list[bytes], where: list[str | None]) -> tuple[int, list, dict]:
        """The longest boundary whose blocks (and state blocks) are somewhere and fit the host tier at once -> (its
        blocks, the (kind, index, tier) of each entry it needs, the tier of each state block)."""
        size, offloader = rank.block_size, self.offloaders[rank.index]
        count = next((i for i, w in enumerate(where) if w is None), len(where))
        while True:
            state_where = {} if rank.states is None or not count else \
                {i: self._tier(rank, STATE, usable[i]) for i in range(rank.state_start(count * size) // size, count)}
            needed = [(BLOCK, i, where[i]) for i in range(count)] + [(STATE, i, w) for i, w in state_where.items()]
            below = {kind: sum(1 for k, _, w in needed if k == kind and w != "device") for kind in (BLOCK, STATE)}
            if not count or (None not in state_where.values() and all(below[kind] <= offloader.host[kind].slots
                                                                      for kind in below)):
                return count, needed, state_where
            count -= 1

    @staticmethod
    def _hold_host(offloader: Offloader, needed: list, usable: list[bytes]) -> None:
        for kind, i, w in needed:
            if w == "host":
                offloader.hold(kind, usable[i])

    def _restore(self, rank, request, usable: list[bytes], state_where: dict, host_states: list[int],
                 count: int) -> None:
        """The hit's state blocks held (the device's) or filled from the host tier, for its first step's restore."""
        states, offloader = rank.states, self.offloaders[rank.index]
        pairs = {i: states.cached[usable[i]] for i, w in state_where.items() if w == "device"}
        states.read(request.seq_id, list(pairs.values()))  # held before a fresh one can evict them
        for i in host_states:
            pairs[i] = states.take_for(request.seq_id)
            offloader.load(STATE, usable[i], pairs[i])
            states.put(usable[i], pairs[i])
        request.restore = Restore(request.seq_id, count * rank.block_size, tuple(sorted(pairs.items())))

    def _device_hit(self, rank, request, blocks: list[int]) -> list[int]:
        """The device pool's own hit, when the offloaded one cannot be copied now (counted as device hits)."""
        blocks = rank.with_state(request, blocks)
        self.counts.hit_tokens["device"] += len(blocks) * rank.block_size
        return blocks


class OffloadWorker(KVConnectorWorker):
    """A rank's host slots and disk files (offload_store.py), running each step's ops first thing."""

    def __init__(self, store: OffloadStore):
        self.store = store

    def run(self, meta: OffloadOps) -> list:
        if not isinstance(meta, OffloadOps):
            raise ValueError(f"invalid step batch: {type(meta).__name__} for KV offload")
        return [self.store.run(meta)]

    def finish(self, meta: OffloadOps | None) -> None:
        if meta is not None:
            self.store.flush(meta)
