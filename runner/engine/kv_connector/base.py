"""The KV connector seam: what moves a sequence's KV cache entries between the device cache and somewhere else
(another instance, for P/D disaggregation; host memory and disk, for KV offload) sits behind one interface in two
halves, in the shape of vLLM v1's KVConnectorBase_V1:

- `KVConnector`, the scheduler's side, on rank 0: it answers for prefix hits it can supply, takes requests whose
  blocks come from elsewhere, builds each step's work for every DP index's ranks, hears their reports, and decides
  what a finished request's blocks become;
- `KVConnectorWorker`, every rank's side: it runs a step's work on its rank's cache before the forward and reports.

The scheduler, the worker and the loop (scheduler.py, worker.py, core.py) call only these methods; connectors
combine as a list (multi.py, vLLM's MultiConnector), in the order their work runs on a rank. One step, in order:

1. between steps, for each new request: `check` (the door's thread: refuse what this connector cannot take), then
   `take` (True: the connector holds the request until its blocks are in; it comes back through `poll`'s events);
   a request that could not be added at all: `rejected`;
2. building the step, for each waiting request about to start with nothing computed: `hit` (the device pool's hit
   extended from the connector's storage, or None: wait a step); whenever a published block is given out again:
   `evicted`; at the end, per DP rank: `step_meta` (what that rank's ranks run, carried by its Batch);
3. on every rank, first thing in the step: `KVConnectorWorker.run(meta)` -> a report, gathered to rank 0;
4. on rank 0, before the step's results are taken: `reported(reports, ranks)` -> events (requests ready, requests
   failed);
5. a request that finishes: `finished` (its kv_transfer_params for the client, if any); one that leaves
   otherwise (aborted, failed): `removed`;
6. the loop, each time round: `poll(now, ranks)` -> events and when to poll again; at a graceful stop: `stop` -> each DP
   index's last work, which `KVConnectorWorker.finish` runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from dsconv.errors import InputError

if TYPE_CHECKING:
    from dsconv.runner.engine.dp_rank import DPRank
    from dsconv.runner.engine.request import SamplingParams
    from dsconv.runner.engine.sequence import Request

T = TypeVar("T")


@dataclass
class Events:
    """What connectors tell the scheduler between steps: requests they held whose blocks are in (queued on their DP
    rank now), requests that fail ((request, error text), ended with an error), and whether anything else the
    metrics show changed (blocks let go, a count)."""
    ready: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)
    changed: bool = False

    def add(self, other: Events) -> Events:
        self.ready += other.ready
        self.failed += other.failed
        self.changed = self.changed or other.changed
        return self


class StepMeta:
    """One connector's work for one DP index's ranks in one step (vLLM's KVConnectorMetadata), pickled with the
    step's Batch; `validate` checks it where it is built and again on the ranks (ValueError)."""

    def validate(self, block_size: int, num_blocks: int) -> None:
        return None


class KVConnector:
    """The scheduler's side of a connector (the module's docstring gives the call order). The defaults do nothing:
    a connector overrides what it takes part in."""
    takes_handoffs = False  # it checks requests' kv_transfer_params (one connector of a list at most)
    supplies_hits = False  # its `hit` looks beyond the device pool

    def find(self, kind: type[T]) -> T | None:
        """This connector, or the one of the list, of class `kind` (None without one)."""
        return self if isinstance(self, kind) else None

    # -- admission ---------------------------------------------------------------------------------------------

    def check(self, prompt_ids: list[int], params: SamplingParams, block_size: int) -> None:
        """Refuses (InputError) a request this connector cannot take; any thread calls it. Without a connector that
        takes hand-overs, a request carrying kv_transfer_params is refused."""
        if params.kv_transfer is not None:
            raise InputError(f"kv_transfer_params for a {params.kv_transfer.role}: this server is not disaggregated "
                             f"(--kv-transfer-config)")

    def take(self, request: Request, rank: DPRank) -> bool:
        """A new request, placed on `rank`: True when the connector holds it until its blocks arrive (it comes back
        as ready, or failed, in a later `poll`'s or `reported`'s events)."""
        return False

    def rejected(self, params: SamplingParams) -> None:
        """A request that could not be added: let go at once of what its params hold elsewhere."""

    # -- building a step ---------------------------------------------------------------------------------------

    def hit(self, request: Request, rank: DPRank, usable: list[bytes], blocks: list[int]) -> list[int] | None:
        """A request about to start with nothing computed; usable: its prompt's full blocks' hashes that a hit may
        cover (its last token is always computed), blocks: the device pool's hit among them -> the hit's blocks,
        the request's table started with them (and, on a cache with state blocks, request.restore set), or None
        when the request must wait a step. By default the device's own hit, cut to a boundary with state."""
        return rank.with_state(request, blocks)

    def evicted(self, rank: int, kind: str, block: int, digest: bytes) -> None:
        """DP rank `rank`'s pool gives out again published `block` (kind "block", or "state" for a state block)."""

    def step_meta(self, rank: DPRank) -> StepMeta | None:
        """This step's work for `rank`'s ranks (None: nothing)."""
        return None

    @property
    def has_step_work(self) -> bool:
        """Work waits for the next step even if no request runs (the loop schedules one)."""
        return False

    # -- after a step ------------------------------------------------------------------------------------------

    def reported(self, reports: list, ranks: list[DPRank]) -> Events:
        """Every rank's reports of the step (every connector's, in rank order; each takes its own); ranks: the
        scheduler's DP ranks."""
        return Events()

    def finished(self, request: Request, rank: DPRank) -> dict | None:
        """A request that ends, its blocks still held -> its response's kv_transfer_params, or None."""
        return None

    def removed(self, request: Request) -> None:
        """A request that leaves (finished, aborted or failed): whatever the connector tracks of it goes."""

    # -- the loop ----------------------------------------------------------------------------------------------

    def poll(self, now: float, ranks: list[DPRank]) -> tuple[Events, float | None]:
        """The loop's turn (now: time.monotonic(); ranks: the scheduler's DP ranks) -> (events, seconds until this
        connector needs its next turn; None: only when something else wakes the loop)."""
        return Events(), None

    @property
    def holding(self) -> bool:
        """The connector holds requests outside the scheduler's queues (a drain waits for them)."""
        return False

    def release(self, transfer_id: str) -> bool:
        """Any thread: the lease `transfer_id` ends (a P/D consumer's word) -> whether it was still held. Its blocks
        go at the loop's next `poll` (the caller wakes the loop: EngineClient.wake)."""
        return False

    def stop(self) -> dict[int, StepMeta] | None:
        """A graceful stop: per DP index, the work its ranks run before they exit (None: none)."""
        return None

    def health(self) -> dict[str, str]:
        """What /health reports of the connector."""
        return {}

    def summary(self) -> str:
        """The server's ready line's part ("" for none)."""
        return ""


class KVConnectorWorker:
    """A rank's side of a connector: the step's work on this rank's cache, before the forward."""

    def run(self, meta: StepMeta) -> list:
        """-> this rank's reports of the work (gathered to rank 0's `KVConnector.reported`)."""
        return []

    def finish(self, meta: StepMeta | None) -> None:
        """The end of the run, on every rank: a graceful stop's last work (meta), or None."""
