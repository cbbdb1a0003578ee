"""P/D disaggregation as connectors (engine/kv_transfer.py says how the hand-over runs; engine/handoff.py is the
block pools' side): a producer leases a finished request's prompt blocks to a consumer (`ProducerConnector`); a
consumer reads them into fresh blocks before the request starts and publishes them once the producer says the lease
held for the whole read (`ConsumerConnector`). On every rank, `TransferWorker` holds the rank's Mooncake transfer
engine and runs a consumer's reads."""

from __future__ import annotations

import itertools
import queue
import threading
import time
import uuid
from dataclasses import dataclass

from dsconv.comm.kv_transfer import TransferAgent
from dsconv.errors import InputError
from dsconv.runner.engine.handoff import (Lease, check_offer, close_lease, drop_load, finish_load, offered,
                                          open_lease, plan_load)
from dsconv.runner.engine.kv_auth import ReplayGuard
from dsconv.runner.engine.kv_connector.base import Events, KVConnector, KVConnectorWorker, StepMeta
from dsconv.runner.engine.kv_release import end_lease
from dsconv.runner.engine.kv_transfer import Export, KVTransferConfig, Load, LoadReport, Offer, RankRegions, run_load

# An idle consumer loop that waits for a producer's answer (a loopback or LAN HTTP exchange, milliseconds) looks for
# it this often: well under a decode step, and only while such an answer is outstanding.
ANSWER_POLL_S = 0.005


class _Handoffs(KVConnector):
    """What both roles share: the role's kv_transfer_params checked at the door."""
    takes_handoffs = True

    def __init__(self, config: KVTransferConfig):
        self.config = config
        self.replays = ReplayGuard()  # a consumer's: the offers taken, each taken once
        self.leases: dict[str, Lease] = {}
        self.leases_expired = self.load_failures = self.received_tokens = 0  # in all

    def check(self, prompt_ids, params, block_size: int) -> None:
        """Refuses kv_transfer_params this instance's role cannot take, or an offer that is not this prompt's, not
        signed with our key, expired or taken before (the door's threads call this: ReplayGuard locks)."""
        handoff = params.kv_transfer
        if handoff is None:
            return
        if handoff.role != self.config.role:
            raise InputError(f"kv_transfer_params for a {handoff.role}: this server is {self.config.role} "
                             f"(--kv-transfer-config)")
        if isinstance(handoff, Offer):
            check_offer(handoff, prompt_ids, block_size, params.cache_salt, self.config.key)
            self.replays.take(handoff.transfer_id, handoff.expires_at)


class ProducerConnector(_Handoffs):
    """A producer's leases: a finished request's prompt blocks held for the consumer until it ends the lease (or
    the lease runs out)."""

    def __init__(self, config: KVTransferConfig, offer_ranks: list[tuple[RankRegions, ...]]):
        """offer_ranks: per DP index, its ranks' transfer sessions and cache regions, which its offers name."""
        if config.release_url is None:  # serve sets it once it listens: an offer must say where to end it
            raise ValueError("a P/D producer's engine needs its own URL (KVTransferConfig.release_url)")
        super().__init__(config)
        self.offer_ranks, self.engine_id = offer_ranks, uuid.uuid4().hex
        self._ends: dict[str, float] = {}  # the open leases' ends, for the HTTP thread's answers (under _lock)
        self._lock = threading.Lock()
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()  # ended by consumers, for the loop to close
        self._holders = itertools.count(-1, -1)  # the leases' pseudo-sequences: ids no request has (those count up)

    def finished(self, request, rank) -> dict | None:
        """A request that hands over: its prompt's blocks held for the consumer -> its kv_transfer_params."""
        if not isinstance(request.params.kv_transfer, Export):
            return None
        pool, states = rank.blocks, rank.states
        count, blocks, pairs = offered(pool, states, request.hashes, len(request.prompt), rank.state_start)
        lease = open_lease(pool, states, next(self._holders), rank.index, blocks, pairs, self.config.lease_s)
        self.leases[lease.transfer_id] = lease
        with self._lock:
            self._ends[lease.transfer_id] = lease.expires
        return Offer(self.engine_id, lease.transfer_id, pool.block_size, tuple(request.hashes[:count]),
                     tuple(blocks), tuple(pairs), self.offer_ranks[rank.index], self.config.release_url,
                     lease.expires_at).signed(self.config.key).params()

    def release(self, transfer_id: str) -> bool:
        """Any thread (the consumer's POST): the lease ends -> whether it was still held. Answered here, not by the
        loop (whose step may be long): the loop frees a lease's blocks only at its end (`expires`, on the same
        clock) or once it has taken this release, so a lease still open before its end has held them until now."""
        with self._lock:
            expires = self._ends.pop(transfer_id, None)
        self._released.put(transfer_id)
        return expires is not None and time.monotonic() < expires

    def close(self, transfer_id: str, now: float, ranks) -> bool:
        """The loop's: the lease's blocks go back to its DP rank's pool -> whether it was still held until `now`."""
        lease = self.leases.pop(transfer_id, None)
        if lease is None:
            return False
        with self._lock:
            self._ends.pop(transfer_id, None)
        close_lease(ranks[lease.dp_rank].blocks, ranks[lease.dp_rank].states, lease)
        if lease.expires <= now:
            self.leases_expired += 1
            return False
        return True

    def poll(self, now: float, ranks) -> tuple[Events, float | None]:
        """Closes the leases consumers ended and those past their time -> seconds until the next one ends."""
        held = len(self.leases)
        while True:
            try:
                self.close(self._released.get_nowait(), now, ranks)
            except queue.Empty:
                break
        for lease in [lease for lease in self.leases.values() if lease.expires <= now]:
            self.close(lease.transfer_id, now, ranks)
        wait = min((lease.expires - now for lease in self.leases.values()), default=None)
        return Events(changed=len(self.leases) != held), wait


class ConsumerConnector(_Handoffs):
    """A consumer's loads: a request arriving with an offer has its prefix's missing blocks read from the producer
    before it starts; it starts as a prefix hit once the producer says the lease held for the whole read."""

    def __init__(self, config: KVTransferConfig, dp: int, end=end_lease):
        """end(offer, on_answer=None): ends an offer's lease at its producer, from a thread (kv_release.end_lease;
        on_answer(held, why) once P has answered)."""
        super().__init__(config)
        self.end = end
        self.plans: dict[int, tuple] = {}  # seq_id -> (request, its LoadPlan): reading, or waiting for P's answer
        self.confirming: set[int] = set()  # of those, the ones whose blocks arrived
        self.sends: list[list[Load]] = [[] for _ in range(dp)]  # the loads the next step sends, per DP rank
        self._answers: queue.SimpleQueue[tuple[int, bool, str]] = queue.SimpleQueue()  # P's, from HTTP threads

    def take(self, request, rank) -> bool:
        """Takes the blocks the request's prefix needs and queues their read; False when there is nothing to read
        or no room (the request is admitted as any other, and P's lease ends now)."""
        offer = request.params.kv_transfer
        if not isinstance(offer, Offer):
            return False
        plan = plan_load(rank.blocks, rank.states, request.seq_id, request.hashes, len(request.prompt), offer,
                         rank.state_start)
        if plan is None:
            self.end(offer)
            return False
        self.plans[request.seq_id] = request, plan
        self.sends[rank.index].append(Load(request.seq_id, offer.ranks, plan.blocks, plan.state,
                                           self.config.transfer_timeout_s))
        return True

    def rejected(self, params) -> None:
        if isinstance(params.kv_transfer, Offer):  # its producer's lease goes now, not at its end
            self.end(params.kv_transfer)

    def step_meta(self, rank) -> Loads | None:
        loads, self.sends[rank.index] = self.sends[rank.index], []
        return Loads(tuple(loads)) if loads else None

    @property
    def has_step_work(self) -> bool:
        return any(self.sends)

    @property
    def holding(self) -> bool:
        return bool(self.plans)

    def removed(self, request) -> None:
        """A request that goes while its load is planned or read: its read is not sent (its blocks go with it)."""
        if self.plans.pop(request.seq_id, None) is not None:
            self.confirming.discard(request.seq_id)
            rank = request.dp_rank
            self.sends[rank] = [load for load in self.sends[rank] if load.seq_id != request.seq_id]

    def reported(self, reports: list, ranks) -> Events:
        """The ranks' reports of the step's loads: a request whose blocks arrived waits for its producer to say the
        lease held; one whose read failed lets its producer's blocks go, and is recomputed or fails, as
        kv_load_failure_policy says."""
        errors: dict[int, str | None] = {}
        for report in reports:
            if isinstance(report, LoadReport):
                errors[report.seq_id] = errors.get(report.seq_id) or report.error
        events = Events()
        for seq_id, error in errors.items():
            if seq_id not in self.plans or seq_id in self.confirming:  # aborted while its step ran
                continue
            request, _ = self.plans[seq_id]
            if error is None:
                self.confirming.add(seq_id)
                self.end(request.params.kv_transfer, self._answer_to(seq_id))
                continue
            self.end(request.params.kv_transfer)
            events.add(self._failed(seq_id, error, ranks))
        return events

    def _answer_to(self, seq_id: int):
        return lambda held, why: self._answers.put((seq_id, held, why))

    def poll(self, now: float, ranks) -> tuple[Events, float | None]:
        """The producers' answers for requests whose blocks arrived: held, the blocks are published and the request
        starts from them as from a prefix hit; otherwise they may be another prompt's, and the load failed."""
        events = Events()
        while True:
            try:
                seq_id, held, why = self._answers.get_nowait()
            except queue.Empty:
                break
            if seq_id not in self.confirming:  # aborted while its producer was asked
                continue
            events.add(self._published(seq_id, ranks) if held else self._failed(seq_id, why, ranks))
        return events, ANSWER_POLL_S if self.confirming else None

    def _published(self, seq_id: int, ranks) -> Events:
        request, plan = self.plans.pop(seq_id)
        self.confirming.discard(seq_id)
        rank = ranks[request.dp_rank]
        request.restore = finish_load(rank.blocks, rank.states, seq_id, request.hashes, plan)
        request.num_computed, request.published = plan.length, plan.length // rank.block_size
        request.cached_tokens = plan.local * rank.block_size
        self.received_tokens += plan.length - request.cached_tokens
        return Events(ready=[request])

    def _failed(self, seq_id: int, error: str, ranks) -> Events:
        """Every block the load took let go; the request recomputed or failed."""
        request, _ = self.plans.pop(seq_id)
        self.confirming.discard(seq_id)
        rank = ranks[request.dp_rank]
        drop_load(rank.blocks, rank.states, seq_id)
        self.load_failures += 1
        if self.config.load_failure_policy == "recompute":
            return Events(ready=[request])
        return Events(failed=[(request, f"the KV cache transfer failed: {error}")])


@dataclass(frozen=True)
class Loads(StepMeta):
    """A consumer's reads for one DP index's ranks in one step."""
    loads: tuple[Load, ...]

    def validate(self, block_size: int, num_blocks: int) -> None:
        for load in self.loads:
            if any(not 0 <= dst < num_blocks for _, dst in load.blocks):
                raise ValueError(f"invalid step batch: sequence {load.seq_id} loads into a block outside "
                                 f"0..{num_blocks - 1}")


class TransferWorker(KVConnectorWorker):
    """A rank's part in P/D disaggregation: its transfer engine and its cache's views (cache.transfer_views()); a
    consumer's rank runs the step's reads before anything reads the blocks."""

    def __init__(self, agent: TransferAgent, views, member: int):
        self.agent, self.views, self.member = agent, views, member  # member: this rank's attention-TP index

    def run(self, meta: Loads) -> list:
        if not isinstance(meta, Loads):
            raise ValueError(f"invalid step batch: {type(meta).__name__} for the P/D transfer engine")
        return [run_load(self.agent, self.views, load, self.member) for load in meta.loads]


