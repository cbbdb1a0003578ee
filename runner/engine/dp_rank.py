"""One attention-DP rank as rank 0 schedules it: its cache's allocators (the block pool and, for DeepSeek-V4, the
state pool: block_pool.py), its waiting and running requests, and what it freed and forked since its last step, to
free and copy on its ranks with the next one. The scheduler walks one of these per DP rank; what depends on whether
the cache keeps state blocks is answered here, so the scheduler does not branch on the model."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from dsconv.runner.engine.block_pool import BlockPool, StatePool
from dsconv.runner.engine.sequence import PoolShape, Request, priority_key
from dsconv.runner.models.kv_cache import Fork, Restore


class DPRank:
    def __init__(self, index: int, shape: PoolShape, policy: str,
                 on_evict: Callable[[str, int, bytes], None] | None = None):
        """policy: fcfs or priority (the waiting queue's order); on_evict(kind, block, hash): told before a
        published block ("block") or state block ("state") is given out again."""
        self.index, self.policy, self.state_start = index, policy, shape.state_start
        self.blocks = BlockPool(shape.num_blocks, shape.block_size, _kind(on_evict, "block"))
        self.states = StatePool(shape.state_blocks, shape.block_size, _kind(on_evict, "state")) \
            if shape.state_blocks else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.releases: list[int] = []  # freed here, to free on the ranks next step
        self.forks: list[Fork] = []  # samples forked here, to copy on the ranks

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    # -- queues ------------------------------------------------------------------------------------------------

    def load(self, horizon: int) -> int:
        """The tokens this rank has to feed over the next `horizon` steps, for the requests it holds now."""
        return sum(r.work(horizon) for r in (*self.waiting, *self.running))

    def seqs(self) -> int:
        """The sequences its running requests run as, each request's n samples counted before they fork: what
        --max-num-seqs bounds (and a cache's sequence slots hold)."""
        return sum(r.seqs for r in self.running)

    def enqueue(self, request: Request, front: bool = False) -> None:
        """Into the waiting queue: fcfs at the back, or at the front (front: a preempted request, a sample just
        forked); priority in (priority, arrival) order, wherever it came from."""
        if self.policy == "fcfs":
            self.waiting.appendleft(request) if front else self.waiting.append(request)
            return
        key = priority_key(request)
        at = next((i for i, other in enumerate(self.waiting) if priority_key(other) > key), len(self.waiting))
        self.waiting.insert(at, request)

    def victim(self, scheduled: int) -> Request:
        """The running request to preempt, taken out of the running list, among those not scheduled yet this step:
        fcfs the newest, priority the one of the highest (priority, arrival)."""
        if self.policy == "fcfs":
            return self.running.pop()
        victim = max(self.running[scheduled:], key=priority_key)
        self.running.remove(victim)
        return victim

    def pending(self) -> tuple[list[int], list[Fork]]:
        """What the next step frees and copies on the ranks (taken: each goes once)."""
        releases, forks, self.releases, self.forks = self.releases, self.forks, [], []
        return releases, forks

    def drop(self, request: Request) -> None:
        """A request out of its queue, whichever holds it."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    # -- the cache ---------------------------------------------------------------------------------------------

    def free(self, seq_id: int, releases: list[int] | None = None) -> None:
        """A sequence's blocks and state blocks let go; the ranks free its slot with the next step (releases: the
        list to name it in, the rank's own by default), unless it held no table."""
        if self.states is not None:
            self.states.release(seq_id)
        if seq_id in self.blocks.tables:
            self.blocks.release(seq_id)
            (self.releases if releases is None else releases).append(seq_id)

    def hold_state(self, seq_id: int, start: int, stop: int) -> tuple[tuple[int, int], ...]:
        """The state blocks a sequence writes feeding positions start .. stop - 1 (StatePool.hold; none without)."""
        return () if self.states is None else self.states.hold(seq_id, start, stop)

    def publish(self, seq_id: int, hashes: list[bytes]) -> None:
        """A sequence's first len(hashes) blocks are full and computed: published, with their state blocks."""
        self.blocks.publish(seq_id, hashes)
        if self.states is not None:
            self.states.publish(seq_id, hashes)

    def restored(self, seq_id: int) -> None:
        """The step that restored a sequence's slot has run: the state blocks it read are let go."""
        if self.states is not None:
            self.states.done_reading(seq_id)

    def with_state(self, request: Request, blocks: list[int]) -> list[int]:
        """A prefix hit of `blocks` cut back, on a cache that needs the state at its boundary, to the longest
        boundary whose state blocks are published; those are held until the request's first step restores them
        (request.restore). Unchanged on a cache without state blocks."""
        if self.states is None:
            return blocks
        for count in range(len(blocks), 0, -1):
            pairs = self.states.find(request.hashes[:count], self.state_start(count * self.block_size)
                                     // self.block_size)
            if pairs is not None:
                self.states.read(request.seq_id, [block for _, block in pairs])
                request.restore = Restore(request.seq_id, count * self.block_size, tuple(pairs))
                return blocks[:count]
        return []


def _kind(on_evict: Callable[[str, int, bytes], None] | None, kind: str) -> Callable[[int, bytes], None] | None:
    return None if on_evict is None else lambda block, digest: on_evict(kind, block, digest)
