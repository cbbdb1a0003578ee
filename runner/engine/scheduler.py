"""Continuous batching on rank 0: which tokens every attention-DP rank feeds each step.

vLLM V1's scheduler without phases: each step, per DP rank, the running requests come first (oldest first,
one token each once decoding, the next chunk of a prompt while prefilling), then waiting requests are admitted
in arrival order, everything within the rank's token budget (chunked prefill: a prompt longer than what is
left of the budget is fed in chunks over several steps). The KV cache is allocated here, per DP rank, in
blocks (block_pool.py, the only allocator: the ranks' caches store what each step's batch tells them); when a
running request needs a block and none is free, the newest running request of that rank is preempted (its
blocks freed) and recomputed later from its prompt and the tokens it had generated. A request
is placed on one DP rank at admission and stays there: the least-loaded one by queued and running work in
tokens, ties broken by free blocks (or round-robin, for comparison); a request may also be pinned. Cache-aware
placement (with prefix caching) counts the request's own uncached prompt in each rank's work, so a rank whose pool
holds its prefix wins unless its load exceeds the least-loaded rank's by more than the tokens the hit saves.

A request for n > 1 samples is one sequence until its prompt is in the cache: the step that feeds the prompt's
last token draws all n first tokens from that row (sample i with seed + i), and the n - 1 further samples start
as sequences of their own on the same DP rank from a fork of its cache (block_pool.py: the prompt's full blocks
are shared), so the prompt is prefilled once. Admission keeps room in max_num_seqs for all n.

Prefix caching (`prefix_caching`): a request admitted with nothing computed starts from the longest run of its
first full blocks that its DP rank's pool has published (block_pool.py), leaving at least its last token to compute
so that its logits exist; after each step every running sequence's full, computed blocks are published. A request
that scores its prompt (prompt_logprobs) needs every row and takes no cached block. DeepSeek-V4's caches also need
the state a sequence slot holds at the hit's boundary: each step writes its tokens' state into state blocks
(block_pool.StatePool, one per DP rank, published with the blocks), and a hit is cut back to the longest boundary
whose state blocks are still cached, which the ranks restore into the new sequence's slot (batch.Restore).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from dsconv.errors import InputError
from dsconv.runner.engine.config import SchedulerConfig
from dsconv.runner.engine.block_pool import BlockPool, StatePool, block_hashes
from dsconv.runner.engine.handoff import (Lease, LoadPlan, check_offer, close_lease, drop_load, finish_load, offered,
                                          open_lease, plan_load)
from dsconv.runner.engine.kv_offload import (BLOCK, STATE, OffloadCounts, Offloader, OffloadOps, OffloadReport,
                                             TierShape)
from dsconv.runner.engine.kv_auth import ReplayGuard
from dsconv.runner.engine.kv_transfer import CONSUMER, PRODUCER, Export, Load, LoadReport, Offer, RankRegions
from dsconv.runner.engine.request import (FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, RequestOutput, SamplingParams,
                                          SeqResult, TokenLogprob, failure_text)
from dsconv.runner.engine.speculative import SpecCounts
from dsconv.runner.engine.batch import Batch, CPShare, PromptScores, SampleSpec
from dsconv.runner.models.kv_cache import Fork, Restore

SEED_BITS = 63  # a request without a seed gets a random one, so every draw is reproducible from (seed, index)


@dataclass
class Request:
    request_id: str
    seq_id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    on_output: Callable[[RequestOutput], None]
    dp_rank: int
    index: int = 0  # which of the request's n samples
    forked: bool = False  # its n samples are drawn (for index 0 of n > 1; the others start so)
    arrival: float = field(default_factory=time.perf_counter)
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens of prompt + output in the cache
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # scored so far (positions 1, 2, ...)
    prompt_delivered: bool = False
    first_scheduled: float | None = None
    last_token: float | None = None
    previous_token: float | None = None  # the time of the token before the last, for inter-token latency
    hashes: list[bytes] = field(default_factory=list)  # its tokens' full blocks' hashes, computed so far
    published: int = 0  # of its blocks, those published in its pool
    cached_tokens: int = 0  # tokens taken from the prefix cache when it was first scheduled
    restore: Restore | None = None  # DeepSeek-V4: the state its first step restores at its prefix hit
    drafts: list[int] = field(default_factory=list)  # speculative decoding: proposed for its next step
    verifying: int = 0  # the drafts its step being run verifies
    load: LoadPlan | None = None  # P/D consumer: the prefix its ranks read from the producer before it starts

    @property
    def key(self) -> tuple[str, int]:
        return self.request_id, self.index

    @property
    def seqs(self) -> int:
        """The sequences it will run as: n until its samples are drawn."""
        return 1 if self.forked else self.params.n

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def scoring(self) -> bool:
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt) - 1

    def work(self, horizon: int) -> int:
        """Tokens this request will feed in the next `horizon` steps at most: its uncomputed prompt (and, after a
        preemption, output) tokens, then one per step for each token it may still generate."""
        return len(self.tokens) - self.num_computed + min(horizon, self.params.max_tokens - len(self.output))


@dataclass
class Step:
    batches: list[Batch]  # one per DP rank
    started: list[Request]  # requests scheduled for the first time in this step
    preempted: list[int]  # per DP rank


@dataclass(frozen=True)
class PoolShape:
    """The ranks' KV caches as rank 0's block pools mirror them: `dp` of them (one per attention-DP index), each of
    `num_blocks` blocks of `block_size` tokens. prefix_caching: the cache can serve prefix hits (kv_cache.py's
    prefix_caching); state_blocks: the state blocks per DP rank of a cache that needs them for a hit (DeepSeek-V4),
    and state_start(boundary) the first position whose state a hit at that boundary restores."""
    dp: int
    num_blocks: int
    block_size: int
    prefix_caching: bool = False
    state_blocks: int = 0
    state_start: Callable[[int], int] | None = None

    @classmethod
    def of(cls, dp: int, cache) -> "PoolShape":
        """The pools mirroring `cache` (a rank's KVCache), on each of dp attention-DP ranks."""
        return cls(dp, cache.num_blocks, cache.block_size, cache.prefix_caching, cache.state_blocks,
                   cache.state_start)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pools: PoolShape, eos_token_id: int | None = None,
                 speculative_tokens: int = 0):
        """config: the flags (checked where they are built, config.py); with cp_size > 1, a prompt of at least
        cp_min_tokens tokens, none computed, is prefilled by its DP rank's group of cp_size ranks in one step
        (context parallelism). Prefix caching runs where the flag asks and the cache can (pools.prefix_caching).
        speculative_tokens: the drafts the MTP layer proposes per step for a greedy request (engine/speculative.py;
        0: none)."""
        dp, block_size = pools.dp, pools.block_size
        self.dp, self.max_num_seqs, self.budget = dp, config.max_num_seqs, config.max_num_batched_tokens
        self.policy, self.eos_token_id, self.balancing = config.scheduling_policy, eos_token_id, config.balancing
        self.pools = [BlockPool(pools.num_blocks, block_size) for _ in range(dp)]
        self.waiting: list[deque[Request]] = [deque() for _ in range(dp)]
        self.running: list[list[Request]] = [[] for _ in range(dp)]
        self.requests: dict[tuple[str, int], Request] = {}  # (request id, sample index) -> its sequence
        self.by_seq: dict[int, Request] = {}  # the same requests by their sequence id (the ranks' name for them)
        self.releases: list[list[int]] = [[] for _ in range(dp)]  # freed here, to free on the ranks next step
        self.forks: list[list[Fork]] = [[] for _ in range(dp)]  # samples forked here, to copy on the ranks
        self.cp_size, self.cp_min_tokens = config.cp_size, config.cp_min_tokens
        self.cp_prefills = 0  # in all
        self._seq_ids, self._round_robin = itertools.count(), itertools.cycle(range(dp))
        self.preemptions = 0  # in all, over every rank
        self.prefix_caching = config.enable_prefix_caching and pools.prefix_caching
        self.prefix_queries = self.prefix_hits = 0  # tokens looked up in the prefix cache, and found, in all
        self.states = [StatePool(pools.state_blocks, block_size) for _ in range(dp)] if pools.state_blocks else None
        self.state_start = pools.state_start
        self._restored: list[tuple[int, int]] = []  # (DP rank, seq_id) restored in the step being run
        self.speculative_tokens = speculative_tokens
        self.spec = SpecCounts()
        # P/D disaggregation (engine/handoff.py): a producer's leases, a consumer's loads (sent with the next step)
        self.kv_transfer = config.kv_transfer
        self.leases: dict[str, Lease] = {}
        # told of each lease opened (its end) and closed (None): the door answers producers' releases from it
        self.on_lease: Callable[[str, float | None], None] = lambda transfer_id, expires: None
        self.leases_expired = 0  # in all
        self.load_failures = 0  # loads that failed, in all
        self.received_tokens = 0  # prompt tokens whose entries loads brought, in all
        self.loading: dict[int, Request] = {}  # seq_id -> a request whose prefix its ranks are reading
        # seq_id -> a request whose prefix arrived, waiting for its producer to say the lease held for the read
        self.confirming: dict[int, Request] = {}
        self.replays = ReplayGuard()  # a consumer's: the offers taken, each taken once
        self.sends: list[list[Load]] = [[] for _ in range(dp)]
        self.engine_id = uuid.uuid4().hex
        # a producer's: the ranks of an attention-DP index, with what a consumer needs to read their caches
        self.offer_ranks: Callable[[int], tuple[RankRegions, ...]] | None = None
        # KV offload (engine/kv_offload.py): each DP rank's host and disk tiers below its pool (attach_offload)
        self.offloaders: list[Offloader] | None = None
        self.offload_counts = OffloadCounts()
        self.failures: list[tuple[str, str, Exception]] = []  # requests failed alone, for the loop to count (fail)

    def attach_offload(self, shape: TierShape, disk_found: list[tuple[dict, dict]] | None) -> None:
        """Host (and disk) tiers under every DP rank's pools; disk_found: per DP index, per kind the hashes every
        rank of it has a file for, oldest first, and those only some have (offload_store.agree; None: no disk
        tier)."""
        if not self.prefix_caching:
            raise InputError("KV offload keeps the prefix cache's blocks: it needs prefix caching on")
        known, strays = zip(*disk_found) if disk_found is not None else ([None] * self.dp, [None] * self.dp)
        self.offloaders = [Offloader(shape, known[rank], self.offload_counts, strays[rank]) for rank in range(self.dp)]
        for rank, offloader in enumerate(self.offloaders):
            self.pools[rank].on_evict = functools.partial(offloader.evicted, BLOCK)
            if self.states is not None:
                self.states[rank].on_evict = functools.partial(offloader.evicted, STATE)

    def flush_offload(self) -> list[OffloadOps | None]:
        """A graceful stop: per DP index, the ops that write its host tier's blocks to disk (Offloader.flush)."""
        return [offloader.flush() for offloader in self.offloaders]

    def offloaded(self, reports: list[OffloadReport]) -> None:
        """Every rank's outcome of the step's offload ops."""
        for report in reports:
            self.offloaders[report.dp_index].reported(report)
        for offloader in self.offloaders:
            offloader.settled()

    # -- admission ---------------------------------------------------------------------------------------------

    def check(self, prompt_len: int, params: SamplingParams, dp_rank: int | None) -> None:
        """Refuses at once what could never run (the front end calls this before submitting)."""
        pool = self.pools[0]
        need = prompt_len + params.max_tokens
        if pool.blocks_for(need) > pool.num_blocks:
            raise InputError(f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) need {need} tokens of "
                             f"KV cache; a DP rank holds {pool.capacity_tokens} (--cache-tokens)")
        if dp_rank is not None and not 0 <= dp_rank < self.dp:
            raise InputError(f"DP rank {dp_rank} is not between 0 and {self.dp - 1}")
        if params.n > self.max_num_seqs:
            raise InputError(f"n={params.n} samples run at once as {params.n} sequences; a DP rank runs at most "
                             f"{self.max_num_seqs} (--max-num-seqs)")
        if params.priority and self.policy != "priority":  # as vLLM refuses it
            raise InputError(f"priority={params.priority} needs --scheduling-policy priority (this server runs "
                             f"{self.policy})")

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, on_output, dp_rank: int | None = None
            ) -> Request:
        self.check(len(prompt), params, dp_rank)
        hashes = block_hashes(prompt, self.pools[0].block_size, params.cache_salt) if self.prefix_caching else []
        rank = dp_rank if dp_rank is not None else self._place(params.max_tokens, len(prompt), hashes)
        seed = params.seed if params.seed is not None else random.getrandbits(SEED_BITS)
        request = Request(request_id, next(self._seq_ids), list(prompt), params, seed, on_output, rank,
                          forked=params.n == 1, hashes=hashes)
        self.requests[request.key] = self.by_seq[request.seq_id] = request
        if not (isinstance(params.kv_transfer, Offer) and self._start_load(request, params.kv_transfer)):
            self._enqueue(rank, request)
        return request

    def load(self, rank: int, horizon: int) -> int:
        """The tokens a DP rank has to feed over the next `horizon` steps, for the requests it holds now."""
        return sum(r.work(horizon) for r in itertools.chain(self.waiting[rank], self.running[rank]))

    def _place(self, max_tokens: int, prompt_len: int, hashes: list[bytes]) -> int:
        """The rank whose load over the new request's lifetime (its prefill and max_tokens decode steps) is
        least: the step imbalance that request lives through is what placing it can change. Each step a rank
        feeds one token per decoding request plus prompt chunks, so counting every request's whole remaining
        output instead would pile short requests onto one rank beside a long one and unbalance every step.
        Cache-aware: each rank's load plus what the request would compute there (its prompt less the tokens that
        rank's prefix cache holds), so a hit of H tokens outweighs a load up to H tokens above the least."""
        if self.balancing == "round-robin":
            return next(self._round_robin)
        horizon = max(1, max_tokens)
        usable = hashes[:(prompt_len - 1) // self.pools[0].block_size]

        def cost(rank: int) -> int:
            if self.balancing != "cache-aware" or not usable:
                return self.load(rank, horizon)
            pool = self.pools[rank]
            return self.load(rank, horizon) + prompt_len - len(pool.match(usable)) * pool.block_size

        return min(range(self.dp), key=lambda r: (cost(r), -self.pools[r].num_free, r))

    def _enqueue(self, rank: int, request: Request, front: bool = False) -> None:
        """Into a rank's waiting queue: fcfs at the back, or at the front (front: a preempted request, a sample just
        forked); priority in (priority, arrival) order, wherever it came from."""
        waiting = self.waiting[rank]
        if self.policy == "fcfs":
            waiting.appendleft(request) if front else waiting.append(request)
            return
        key = _priority(request)
        at = next((i for i, other in enumerate(waiting) if _priority(other) > key), len(waiting))
        waiting.insert(at, request)

    def _victim(self, running: list[Request], scheduled: int) -> Request:
        """The running request to preempt, among those not scheduled yet this step: fcfs the newest, priority the
        one of the highest (priority, arrival)."""
        if self.policy == "fcfs":
            return running.pop()
        victim = max(running[scheduled:], key=_priority)
        running.remove(victim)
        return victim

    def seqs(self, rank: int) -> int:
        """The sequences a DP rank's running requests run as, each request's n samples counted before they fork:
        what --max-num-seqs bounds (and a cache's sequence slots hold)."""
        return sum(r.seqs for r in self.running[rank])

    @property
    def has_work(self) -> bool:
        return any(self.waiting) or any(self.running) or any(self.sends)

    # -- one step ----------------------------------------------------------------------------------------------

    def schedule(self) -> Step | None:
        """The next step's batches, or None when no DP rank has anything to do (nor to free)."""
        if not self.has_work:
            return None
        batches, started, preempted = [], [], [0] * self.dp
        shares = self._context_parallel(started)
        for rank in range(self.dp):
            batch = Batch(releases=self.releases[rank], forks=self.forks[rank], loads=self.sends[rank])
            budget, self.releases[rank], self.forks[rank], self.sends[rank] = self.budget, [], [], []
            pool, running, scheduled = self.pools[rank], self.running[rank], 0
            if rank in shares:  # the rank gives this step to a context-parallel prefill
                share, request = shares[rank]
                batch.cp, batch.input_ids = share, [request.prompt[p] for p in share.positions]
                batch.validate(pool.block_size, pool.num_blocks)
                batches.append(batch)
                continue
            while scheduled < len(running) and budget > 0:
                request = running[scheduled]
                n = min(len(request.tokens) + len(self._usable_drafts(request)) - request.num_computed, budget)
                while pool.missing(request.seq_id, self._room(request, n)) > pool.num_free:
                    self._preempt(self._victim(running, scheduled), rank, batch)  # never one already scheduled
                    preempted[rank] += 1
                    if request not in running:
                        break
                else:
                    budget -= self._feed(batch, pool, request, n)
                    scheduled += 1
            waiting = self.waiting[rank]
            while waiting and budget > 0 and self.seqs(rank) + waiting[0].seqs <= self.max_num_seqs:
                request = waiting[0]
                if not self._reuse_prefix(pool, request):
                    break  # its prefix is being read from disk: it starts next step
                n = min(len(request.tokens) - request.num_computed, budget)
                if pool.missing(request.seq_id, self._room(request, n)) > pool.num_free:
                    break  # arrival order: nobody overtakes the first waiting request
                running.append(waiting.popleft())
                if request.first_scheduled is None:
                    request.first_scheduled = time.perf_counter()
                    started.append(request)
                budget -= self._feed(batch, pool, request, n)
            batch.validate(pool.block_size, pool.num_blocks)  # where it is built; the ranks check it again
            batches.append(batch)
        if self.offloaders is not None:  # every rank's evictions and hits of this step, copied before it runs
            for batch, offloader in zip(batches, self.offloaders):
                batch.offload = offloader.take_ops()
        return Step(batches, started, preempted)

    def _context_parallel(self, started: list[Request]) -> dict[int, tuple[CPShare, Request]]:
        """This step's context-parallel prefills: in each group of cp_size DP ranks, the earliest of the waiting
        requests at the head of a member's queue whose prompt fits its rank's cache and sequence limit and leaves at
        least cp_min_tokens uncached (prefix caching: looked up first) -> DP rank -> (its share, the request). The
        request is admitted on its own rank (the owner) with the rest of its prompt computed in this step; the
        owner's cached prefix is handed to the other members in each layer (deepseek_v3.Attention)."""
        shares: dict[int, tuple[CPShare, Request]] = {}
        for first in range(0, self.dp if self.cp_size > 1 else 0, self.cp_size):
            members = range(first, first + self.cp_size)
            heads = [self.waiting[r][0] for r in members if self.waiting[r]]
            for request in heads:
                if self.states is None:  # no context-parallel prefill restores a slot (V4 has none)
                    self._reuse_prefix(self.pools[request.dp_rank], request)
            ready = [request for request in heads if self._cp_ready(request)]
            if not ready:
                continue
            request = min(ready, key=lambda r: r.arrival)
            owner, length, start = request.dp_rank, len(request.prompt), request.num_computed
            self.waiting[owner].popleft()
            self.running[owner].append(request)
            if request.first_scheduled is None:
                request.first_scheduled = time.perf_counter()
                started.append(request)
            table = tuple(self.pools[owner].grow(request.seq_id, length))
            request.num_computed = length
            self.cp_prefills += 1
            group = (owner, *[r for r in members if r != owner])
            for member, rank in enumerate(group):
                share = CPShare(request.seq_id, length, group, member, start=start)
                scores = None
                if request.scoring:  # each member scores its own rows (every position but the last)
                    targets = [request.prompt[p + 1] for p in share.scored_positions]
                    scores = PromptScores(targets, request.params.prompt_logprobs) if targets else None
                owner_parts = {"block_table": table, "sample": self._sample_spec(request)} if member == 0 else {}
                shares[rank] = dataclasses.replace(share, scores=scores, **owner_parts), request
        return shares

    def _cp_ready(self, request: Request) -> bool:
        pool, rank = self.pools[request.dp_rank], request.dp_rank
        # a waiting request without output has computed only what its prefix hit gave it
        return (not request.output and len(request.prompt) - request.num_computed >= self.cp_min_tokens
                and pool.missing(request.seq_id, len(request.prompt)) <= pool.num_free
                and self.seqs(rank) + request.seqs <= self.max_num_seqs)

    def _reuse_prefix(self, pool: BlockPool, request: Request) -> bool:
        """A request about to be admitted with nothing computed and no table yet starts from its longest published
        prefix of full blocks, its last token always left to compute -> False when part of that prefix is being read
        from the disk tier (the request waits a step; KV offload)."""
        if not self.prefix_caching or request.num_computed or request.seq_id in pool.tables or request.scoring:
            return True
        tokens = request.tokens
        request.hashes = block_hashes(tokens, pool.block_size, request.params.cache_salt, request.hashes)
        usable = request.hashes[:(len(tokens) - 1) // pool.block_size]
        blocks = pool.match(usable)
        if self.offloaders is not None:
            blocks = self._reuse_offloaded(pool, request, usable, blocks)
            if blocks is None:
                return False
        elif self.states is not None:
            blocks = self._with_state(request, blocks)
        self.prefix_queries += len(tokens)
        self.prefix_hits += len(blocks) * pool.block_size
        # its table starts now, empty without a hit: a request that waits on is looked up (and counted) once
        if request.seq_id not in pool.tables:
            pool.adopt(request.seq_id, blocks)
        request.num_computed = len(blocks) * pool.block_size
        if request.first_scheduled is None:
            request.cached_tokens = request.num_computed
        return True

    def _reuse_offloaded(self, pool: BlockPool, request: Request, usable: list[bytes], blocks: list[int]
                         ) -> list[int] | None:
        """The device pool's hit (`blocks`, of the prompt's usable hashes) extended through the host and disk tiers
        (engine/kv_offload.py), cut back (DeepSeek-V4) to the longest boundary whose state blocks some tier holds ->
        the hit's blocks, the request's table started with them: the host tier's copied into fresh blocks by this
        step's ops. None when part of it is on disk: its reads go out with this step, and the request waits for them
        (or while another request's reads of it are unchecked)."""
        rank, size = request.dp_rank, pool.block_size
        offloader, states = self.offloaders[rank], self.states[rank] if self.states is not None else None

        def tier(kind: str, digest: bytes) -> str | None:
            device = pool.cached if kind == BLOCK else states.cached
            return "device" if digest in device else offloader.where(kind, digest)

        where = [tier(BLOCK, digest) for digest in usable]
        count = next((i for i, w in enumerate(where) if w is None), len(where))
        while True:  # the longest boundary whose blocks (and state blocks) are somewhere and fit the host tier at once
            state_where = {} if states is None or not count else \
                {i: tier(STATE, usable[i]) for i in range(self.state_start(count * size) // size, count)}
            needed = [(BLOCK, i, where[i]) for i in range(count)] + [(STATE, i, w) for i, w in state_where.items()]
            below = {kind: sum(1 for k, _, w in needed if k == kind and w != "device") for kind in (BLOCK, STATE)}
            if not count or (None not in state_where.values() and all(below[kind] <= offloader.host[kind].slots
                                                                      for kind in below)):
                break
            count -= 1
        if any(w == "pending" for _, _, w in needed):
            return None
        on_disk = [(kind, usable[i]) for kind, i, w in needed if w == "disk"]
        if on_disk:  # read into host slots by this step; the hit's host entries kept there meanwhile
            for kind, i, w in needed:
                if w == "host":
                    offloader.hold(kind, usable[i])
            if not offloader.fetch(on_disk):
                return self._device_hit(request, blocks)  # no host slot free for them now
            return None
        host_states = [i for i, w in state_where.items() if w == "host"]
        if states is not None and len(host_states) > states.num_free:
            return self._device_hit(request, blocks)
        for kind, i, w in needed:  # before the blocks the copies go to are taken (their evictions take slots)
            if w == "host":
                offloader.hold(kind, usable[i])
        table = pool.adopt_with(request.seq_id, [pool.cached[usable[i]] if where[i] == "device" else None
                                                 for i in range(count)])
        if table is None:  # no room for the copies
            return self._device_hit(request, blocks)
        for i in range(count):
            found = where[i] if where[i] == "device" else offloader.load(BLOCK, usable[i], table[i])
            self.offload_counts.hit_tokens[found] += size
        pool.publish(request.seq_id, usable[:count])
        if states is not None and count:
            pairs = {i: states.cached[usable[i]] for i, w in state_where.items() if w == "device"}
            states.read(request.seq_id, list(pairs.values()))  # held before a fresh one can evict them
            for i in host_states:
                pairs[i] = states.take_for(request.seq_id)
                offloader.load(STATE, usable[i], pairs[i])
                states.put(usable[i], pairs[i])
            request.restore = Restore(request.seq_id, count * size, tuple(sorted(pairs.items())))
        return table

    def _device_hit(self, request: Request, blocks: list[int]) -> list[int]:
        """The device pool's own hit, when the offloaded one cannot be copied now (counted as device hits)."""
        if self.states is not None:
            blocks = self._with_state(request, blocks)
        self.offload_counts.hit_tokens["device"] += len(blocks) * self.pools[request.dp_rank].block_size
        return blocks

    def _with_state(self, request: Request, blocks: list[int]) -> list[int]:
        """A hit on a cache that needs the state at its boundary: cut back to the longest boundary whose state
        blocks are published, which the request holds until its first step restores them."""
        states, block_size = self.states[request.dp_rank], self.pools[request.dp_rank].block_size
        for count in range(len(blocks), 0, -1):
            pairs = states.find(request.hashes[:count], self.state_start(count * block_size) // block_size)
            if pairs is not None:
                states.read(request.seq_id, [block for _, block in pairs])
                request.restore = Restore(request.seq_id, count * block_size, tuple(pairs))
                return blocks[:count]
        return []

    def _publish(self) -> None:
        """After a step: every running sequence's full blocks that the step completed, published in its pool."""
        for rank, running in enumerate(self.running):
            pool = self.pools[rank]
            for request in running:
                full = request.num_computed // pool.block_size
                if full > request.published and request.seq_id in pool.tables:
                    request.hashes = block_hashes(request.tokens[:full * pool.block_size], pool.block_size,
                                                  request.params.cache_salt, request.hashes[:full])
                    pool.publish(request.seq_id, request.hashes[:full])
                    if self.states is not None:
                        self.states[rank].publish(request.seq_id, request.hashes[:full])
                    request.published = full

    def _sample_spec(self, request: Request, drafts: list[int] = ()) -> SampleSpec | None:
        """What to draw once the request's tokens are all fed (None when it generates nothing): with speculative
        decoding, the drafts the step verifies, and how many the MTP layer proposes for the next."""
        params = request.params
        if params.max_tokens == 0:
            return None
        siblings = () if request.forked else tuple(request.seed + i for i in range(1, params.n))
        penalized = params.repetition_penalty != 1.0
        return SampleSpec(params.temperature, params.top_p, params.top_k, request.seed, len(request.output),
                          params.logprobs, params.grammar, tuple(request.output) if params.grammar else (), siblings,
                          params.logit_bias, tuple(drafts), self._proposes(request),
                          repetition_penalty=params.repetition_penalty,
                          seen=tuple(sorted(set(request.prompt) | set(request.output))) if penalized else (),
                          banned=self._banned(request), min_p=params.min_p)

    def _banned(self, request: Request) -> tuple[int, ...]:
        """The tokens a request may not draw yet: before min_tokens, those that would end it (EOS unless ignored,
        and its stop tokens), as vLLM's min_tokens holds them back."""
        params = request.params
        if len(request.output) >= params.min_tokens:
            return ()
        ends = set(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            ends.add(self.eos_token_id)
        return tuple(sorted(ends))

    def _proposes(self, request: Request) -> int:
        """The drafts the MTP layer proposes for a request after its step (none for a request with a logit_bias, or
        whose n samples are not forked yet; a grammar's masks constrain its drafts and their verification)."""
        params = request.params
        plain = not params.logit_bias and request.forked and params.repetition_penalty == 1.0 \
            and not params.min_p and not params.min_tokens
        return self.speculative_tokens if plain else 0

    @staticmethod
    def _usable_drafts(request: Request) -> list[int]:
        """A decoding request's drafts it can still use: no more than the tokens it may emit after the first."""
        return request.drafts[:max(0, request.params.max_tokens - len(request.output) - 1)]

    def _room(self, request: Request, n: int) -> int:
        """The tokens a request's table must hold to feed n more: with speculative decoding, also the positions the
        MTP layer's chained drafts write past them (its own cache layer), never past the request's longest length
        (the worker stops drafting where the table ends)."""
        longest = len(request.prompt) + request.params.max_tokens
        return min(request.num_computed + n + max(0, self._proposes(request) - 1),
                   max(longest, request.num_computed + n))

    def _feed(self, batch: Batch, pool: BlockPool, request: Request, n: int) -> int:
        start, stop, known = request.num_computed, request.num_computed + n, len(request.tokens)
        drafts = self._usable_drafts(request)[:max(0, stop - known)]  # fed after its last token, when decoding
        table = pool.grow(request.seq_id, self._room(request, stop - start))
        sample = self._sample_spec(request, drafts) if stop >= known else None
        follow = request.tokens[stop] if self.speculative_tokens and stop < known else None
        params = request.params
        scores = None
        if request.scoring:  # rows start .. predict prompt tokens start + 1 ..
            targets = request.prompt[start + 1:min(stop, len(request.prompt) - 1) + 1]
            scores = PromptScores(targets, params.prompt_logprobs) if targets else None
        state = ()
        if self.states is not None:
            state = self.states[request.dp_rank].hold(request.seq_id, start, stop)
            if request.restore is not None:
                batch.restores.append(request.restore)
                self._restored.append((request.dp_rank, request.seq_id))
                request.restore = None
        batch.add(request.seq_id, (request.tokens + drafts)[start:stop], stop, table, pool.block_size, sample, scores,
                  state, follow)
        request.num_computed, request.verifying, request.drafts = stop, len(drafts), []
        return stop - start

    def _preempt(self, request: Request, rank: int, batch: Batch) -> None:
        self.preemptions += 1
        request.drafts = []
        self.pools[rank].release(request.seq_id)
        if self.states is not None:
            self.states[rank].release(request.seq_id)
        batch.releases.append(request.seq_id)
        request.num_computed = request.published = 0
        if request.scoring:
            request.prompt_logprobs = []  # a partly scored prompt is scored again from the start
        self._enqueue(rank, request, front=True)

    # -- results -----------------------------------------------------------------------------------------------

    def update(self, step: Step, results: list[list[SeqResult]]) -> list[tuple[Request, RequestOutput]]:
        """results[rank][i]: the i-th sequence of that rank's batch -> the outputs to deliver (finished requests
        are freed here). A context-parallel prefill's result is its owner's, with the members' scored prompt
        tokens put in position order."""
        self._settle(step, results)
        if self.prefix_caching:  # first: a sequence that finishes in this step still publishes what it computed
            self._publish()
        for rank, seq_id in self._restored:  # their state is in their slots now
            self.states[rank].done_reading(seq_id)
        self._restored = []
        outputs, now = [], time.perf_counter()
        parts: dict[int, list[tuple[CPShare, SeqResult]]] = {}  # context-parallel: seq_id -> the members' results
        for batch, rank_results in zip(step.batches, results, strict=True):
            if batch.cp is not None:
                parts.setdefault(batch.cp.seq_id, []).extend(zip([batch.cp], rank_results, strict=True))
                continue
            for seq_id, result in zip(batch.seq_ids, rank_results, strict=True):
                outputs += self._take_alone(seq_id, result, now)
        for seq_id, members in parts.items():
            scored = sorted(((p, entry) for share, result in members
                             for p, entry in zip(share.scored_positions, result.prompt_logprobs)),
                            key=lambda pair: pair[0])
            owner = next(result for share, result in members if share.member == 0)
            outputs += self._take_alone(seq_id, dataclasses.replace(owner, prompt_logprobs=[e for _, e in scored]),
                                        now)
        return outputs

    def _take_alone(self, seq_id: int, result: SeqResult, now: float) -> list[tuple[Request, RequestOutput]]:
        """_take, where an error of this one request fails it alone (its blocks freed); an error in freeing them is
        the pool's, and stops the engine."""
        request = self.by_seq.get(seq_id)
        if result.error is not None and request is not None:  # failed on the ranks (its grammar)
            return self.fail(request, "sample", RuntimeError(result.error))
        try:
            return self._take(seq_id, result, now)
        except Exception as exc:  # noqa: BLE001  (a request can fail; the engine cannot)
            if request is None:
                raise
            return self.fail(request, "update", exc)

    def fail(self, request: Request, stage: str, exc: Exception) -> list[tuple[Request, RequestOutput]]:
        """Ends a request (every sample not yet forked) with an error -> its final outputs; recorded for
        take_failures."""
        self.failures.append((stage, request.request_id, exc))
        return [(request, dataclasses.replace(out, error=failure_text(stage, exc)))
                for request, out in self.abort(request.request_id, None if not request.forked else request.index)]

    def take_failures(self) -> list[tuple[str, str, Exception]]:
        """The (stage, request id, error) of requests failed since the last call."""
        failures, self.failures = self.failures, []
        return failures

    def _settle(self, step: Step, results: list[list[SeqResult]]) -> None:
        """Speculative decoding: each verifying sequence's computed tokens cut back to its last accepted draft (the
        rejected positions' entries are written over by its next steps), before anything is published."""
        for batch, rank_results in zip(step.batches, results, strict=True):
            for seq_id, result in zip(batch.seq_ids if batch.cp is None else (), rank_results):
                request = self.by_seq.get(seq_id)
                if request is not None and request.verifying:
                    accepted = len(result.extra)
                    request.num_computed -= request.verifying - accepted
                    self.spec.add(request.verifying, accepted, self.speculative_tokens)
                    request.verifying = 0

    def _take(self, seq_id: int, result: SeqResult, now: float) -> list[tuple[Request, RequestOutput]]:
        """One sequence's result -> the outputs it gives (its own, then any samples it starts)."""
        request = self.by_seq.get(seq_id)
        if request is None:  # aborted while the step ran
            return []
        out, samples = RequestOutput(request.request_id, len(request.prompt), index=request.index,
                                     cached_tokens=request.cached_tokens), []
        request.prompt_logprobs.extend(result.prompt_logprobs)
        if request.params.prompt_logprobs is not None and not request.prompt_delivered \
                and not request.scoring and request.num_computed >= len(request.prompt):
            out.prompt_logprobs = [None, *request.prompt_logprobs]
            request.prompt_delivered = True
        if result.token is not None:
            request.previous_token, request.last_token = request.last_token, now
            out.new_token_ids, logprobs = [], []
            for token, logprob in [(result.token, result.logprob), *result.extra]:  # until one finishes it
                request.output.append(token)
                out.new_token_ids.append(token)
                logprobs.append(logprob)
                out.finish_reason = self._finish_reason(request, token)
                if out.finish_reason is not None:
                    break
            out.new_logprobs = logprobs if result.logprob is not None else None
            request.drafts = list(result.drafts)
            if result.siblings:  # before the parent may go: the samples fork its cache
                samples = self._start_samples(request, result.siblings, out.prompt_logprobs, now)
        elif request.params.max_tokens == 0 and not request.scoring and \
                request.num_computed == len(request.prompt):
            out.finish_reason = FINISH_LENGTH  # the prompt is scored and nothing is to be generated
        if out.finish_reason is not None:
            out.finished = True
            if isinstance(request.params.kv_transfer, Export):
                out.kv_transfer_params = self._lease(request)
            self._remove(request)
        emitted = [(request, out)] if out.new_token_ids or out.prompt_logprobs is not None or out.finished else []
        return emitted + samples

    def _start_samples(self, parent: Request, drawn: list, prompt_logprobs, now: float) -> list[tuple]:
        """Samples 1 .. n - 1 of `parent`, whose first tokens were drawn beside its own -> their first outputs.
        Each continues from a fork of the parent's cache, or, when the free blocks do not suffice for a copy of
        its last partial block, from scratch like a preempted request."""
        parent.forked = True
        rank, pool, outputs = parent.dp_rank, self.pools[parent.dp_rank], []
        for index, (token, logprob) in enumerate(drawn, start=1):
            child = Request(parent.request_id, next(self._seq_ids), parent.prompt, parent.params, parent.seed + index,
                            parent.on_output, rank, index=index, forked=True, arrival=parent.arrival, output=[token],
                            prompt_logprobs=list(parent.prompt_logprobs), prompt_delivered=True,
                            first_scheduled=parent.first_scheduled, last_token=now)
            out = RequestOutput(parent.request_id, len(parent.prompt), index=index, new_token_ids=[token],
                                new_logprobs=None if logprob is None else [logprob], prompt_logprobs=prompt_logprobs,
                                finish_reason=self._finish_reason(child, token))
            out.finished = out.finish_reason is not None
            outputs.append((child, out))
            if out.finished:
                continue
            self.requests[child.key] = self.by_seq[child.seq_id] = child
            copies = pool.fork(parent.seq_id, child.seq_id, parent.num_computed)
            if copies is None:
                self._enqueue(rank, child, front=True)
                continue
            child.num_computed = parent.num_computed
            self.forks[rank].append(Fork(parent.seq_id, child.seq_id, tuple(copies)))
            self.running[rank].append(child)
        return outputs

    def _finish_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if (token == self.eos_token_id and not params.ignore_eos) or token in params.stop_token_ids:
            return FINISH_STOP
        if len(request.output) >= params.max_tokens:
            return FINISH_LENGTH
        return None

    def abort(self, request_id: str, index: int | None = None) -> list[tuple[Request, RequestOutput]]:
        """Ends one sample of a request, or (index None) all of them -> their final outputs; a request whose
        samples are not drawn yet ends for all n."""
        aborted = []
        for key in [key for key in self.requests if key[0] == request_id and index in (None, key[1])]:
            request = self.requests[key]
            self._remove(request)
            indices = [request.index] if request.forked else range(request.params.n)
            aborted += [(request, RequestOutput(request_id, len(request.prompt), index=i, finished=True,
                                                finish_reason=FINISH_ABORT)) for i in indices]
        return aborted

    def _remove(self, request: Request) -> None:
        rank = request.dp_rank
        del self.requests[request.key], self.by_seq[request.seq_id]
        self.confirming.pop(request.seq_id, None)
        if self.loading.pop(request.seq_id, None) is not None:  # its load not sent yet is not sent
            self.sends[rank] = [load for load in self.sends[rank] if load.seq_id != request.seq_id]
        if request in self.running[rank]:
            self.running[rank].remove(request)
        elif request in self.waiting[rank]:
            self.waiting[rank].remove(request)
        if self.states is not None:
            self.states[rank].release(request.seq_id)
        if request.seq_id in self.pools[rank].tables:
            self.pools[rank].release(request.seq_id)
            self.releases[rank].append(request.seq_id)

    # -- P/D disaggregation (engine/kv_transfer.py, engine/handoff.py) -------------------------------------------

    def check_handoff(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuses kv_transfer_params this instance's role cannot take, or an offer that is not this prompt's, not
        signed with our key, expired or taken before (the door's threads call this: ReplayGuard locks)."""
        handoff = params.kv_transfer
        if handoff is None:
            return
        role = self.kv_transfer.role if self.kv_transfer is not None else None
        wanted = {Export: PRODUCER, Offer: CONSUMER}[type(handoff)]
        if role != wanted:
            raise InputError(f"kv_transfer_params for a {wanted}: this server is "
                             f"{role or 'not disaggregated'} (--kv-transfer-config)")
        if isinstance(handoff, Offer):
            check_offer(handoff, prompt_ids, self.pools[0].block_size, params.cache_salt, self.kv_transfer.key)
            self.replays.take(handoff.transfer_id, handoff.expires_at)

    def _start_load(self, request: Request, offer: Offer) -> bool:
        """A consumer's request: its prefix's missing blocks taken and their read queued for the next step; False
        when there is nothing to read or no room (the request is then admitted as any other)."""
        rank = request.dp_rank
        plan = plan_load(self.pools[rank], self.states[rank] if self.states else None, request.seq_id,
                         request.hashes, len(request.prompt), offer, self.state_start)
        if plan is None:
            return False
        request.load, self.loading[request.seq_id] = plan, request
        self.sends[rank].append(Load(request.seq_id, offer.ranks, plan.blocks, plan.state,
                                     self.kv_transfer.transfer_timeout_s))
        return True

    def loaded(self, reports: list[LoadReport]) -> tuple[list[tuple[Request, RequestOutput]], list[Request],
                                                         list[Request]]:
        """The ranks' reports of the step's loads -> (outputs of requests that fail, the requests whose blocks
        arrived: their producers must say the lease held (`confirmed`), the requests whose read failed: their
        producers may let the blocks go). A failed read is recomputed here or fails, as kv_load_failure_policy
        says."""
        errors: dict[int, str | None] = {}
        for report in reports:
            errors[report.seq_id] = errors.get(report.seq_id) or report.error
        outputs, arrived, failed = [], [], []
        for seq_id, error in errors.items():
            request = self.loading.pop(seq_id, None)
            if request is None:  # aborted while its step ran
                continue
            if error is None:
                self.confirming[seq_id] = request
                arrived.append(request)
                continue
            failed.append(request)
            outputs += self._load_failed(request, error)
        return outputs, arrived, failed

    def confirmed(self, seq_id: int, held: bool, why: str) -> list[tuple[Request, RequestOutput]]:
        """The producer's answer for a request whose blocks arrived: held, the lease covered the whole read and the
        blocks are published (the request starts from them as from a prefix hit); otherwise they may be another
        prompt's, and the load failed (`why`) -> outputs of a request that fails."""
        request = self.confirming.pop(seq_id, None)
        if request is None:  # aborted while its producer was asked
            return []
        if not held:
            return self._load_failed(request, why)
        rank, plan, request.load = request.dp_rank, request.load, None
        states = self.states[rank] if self.states else None
        request.restore = finish_load(self.pools[rank], states, seq_id, request.hashes, plan)
        request.num_computed, request.published = plan.length, plan.length // self.pools[rank].block_size
        request.cached_tokens = plan.local * self.pools[rank].block_size
        self.received_tokens += plan.length - request.cached_tokens
        self._enqueue(rank, request)
        return []

    def _load_failed(self, request: Request, error: str) -> list[tuple[Request, RequestOutput]]:
        """Every block the load took let go; the request recomputed or failed -> its outputs when it fails."""
        rank, request.load = request.dp_rank, None
        drop_load(self.pools[rank], self.states[rank] if self.states else None, request.seq_id)
        self.load_failures += 1
        if self.kv_transfer.load_failure_policy == "recompute":
            self._enqueue(rank, request)
            return []
        self._remove(request)
        return [(request, RequestOutput(request.request_id, len(request.prompt), index=i, finished=True,
                                        finish_reason=FINISH_ABORT, error=f"the KV cache transfer failed: {error}"))
                for i in range(request.params.n)]

    def _lease(self, request: Request) -> dict:
        """A producer's finished request: its prompt's blocks held for the consumer -> its kv_transfer_params."""
        rank = request.dp_rank
        pool, states = self.pools[rank], self.states[rank] if self.states else None
        count, blocks, pairs = offered(pool, states, request.hashes, len(request.prompt), self.state_start)
        lease = open_lease(pool, states, next(self._seq_ids), rank, blocks, pairs, self.kv_transfer.lease_s)
        self.leases[lease.transfer_id] = lease
        self.on_lease(lease.transfer_id, lease.expires)
        return Offer(self.engine_id, lease.transfer_id, pool.block_size, tuple(request.hashes[:count]),
                     tuple(blocks), tuple(pairs), self.offer_ranks(rank), self.kv_transfer.release_url,
                     lease.expires_at).signed(self.kv_transfer.key).params()

    def release_lease(self, transfer_id: str, now: float | None = None) -> bool:
        """The consumer has read the blocks (or given up): the lease's blocks go back to the pool -> whether the
        lease was still held until now (time.monotonic()), so that no other sequence can have been given its
        blocks during the consumer's read; a lease past its time that the loop has not closed yet was not."""
        lease = self.leases.pop(transfer_id, None)
        if lease is None:
            return False
        self.on_lease(transfer_id, None)
        close_lease(self.pools[lease.dp_rank], self.states[lease.dp_rank] if self.states else None, lease)
        if lease.expires <= (time.monotonic() if now is None else now):
            self.leases_expired += 1
            return False
        return True

    def expire_leases(self, now: float) -> float | None:
        """Closes the leases past their time -> seconds until the next one ends (None: none is held)."""
        for lease in [lease for lease in self.leases.values() if lease.expires <= now]:
            self.release_lease(lease.transfer_id, now)
        return min((lease.expires - now for lease in self.leases.values()), default=None)


def _priority(request: Request) -> tuple[int, float]:
    return request.params.priority, request.arrival
