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

from dsconv.errors import InputError
from dsconv.runner.engine.config import SchedulerConfig
from dsconv.runner.engine.block_pool import block_hashes
from dsconv.runner.engine.dp_rank import DPRank
from dsconv.runner.engine.kv_connector.base import Events, KVConnector
from dsconv.runner.engine.request import (FINISH_ABORT, RequestOutput, SamplingParams,
                                          SeqResult, failure_text)
from dsconv.runner.engine import context_parallel, step_results
from dsconv.runner.engine.sample_plan import SamplePlan
from dsconv.runner.engine.sequence import PoolShape, Request, Step
from dsconv.runner.engine.speculative import SpecCounts
from dsconv.runner.engine.batch import Batch, PromptScores

SEED_BITS = 63  # a request without a seed gets a random one, so every draw is reproducible from (seed, index)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pools: PoolShape, eos_token_id: int | None = None,
                 speculative_tokens: int = 0, connector: KVConnector | None = None):
        """config: the flags (checked where they are built, config.py); with cp_size > 1, a prompt of at least
        cp_min_tokens tokens, none computed, is prefilled by its DP rank's group of cp_size ranks in one step
        (context parallelism). Prefix caching runs where the flag asks and the cache can (pools.prefix_caching).
        speculative_tokens: the drafts the MTP layer proposes per step for a greedy request (engine/speculative.py;
        0: none). connector: where KV cache entries come from and go besides the device cache (engine/kv_connector/),
        told of every DP rank's evictions."""
        dp = pools.dp
        self.dp, self.max_num_seqs, self.budget = dp, config.max_num_seqs, config.max_num_batched_tokens
        self.policy, self.balancing = config.scheduling_policy, config.balancing
        self.connector = connector if connector is not None else KVConnector()
        self.ranks = [DPRank(index, pools, config.scheduling_policy, functools.partial(self.connector.evicted, index))
                      for index in range(dp)]
        self.requests: dict[tuple[str, int], Request] = {}  # (request id, sample index) -> its sequence
        self.by_seq: dict[int, Request] = {}  # the same requests by their sequence id (the ranks' name for them)
        self.cp_size, self.cp_min_tokens = config.cp_size, config.cp_min_tokens
        self.cp_prefills = 0  # in all
        self._seq_ids, self._round_robin = itertools.count(), itertools.cycle(range(dp))
        self.preemptions = 0  # in all, over every rank
        self.prefix_caching = config.enable_prefix_caching and pools.prefix_caching
        self.prefix_queries = self.prefix_hits = 0  # tokens looked up in the prefix cache, and found, in all
        self._restored: list[tuple[DPRank, int]] = []  # (DP rank, seq_id) restored in the step being run
        self.plan = SamplePlan(eos_token_id, speculative_tokens)  # what each step draws; its drafts
        self.spec = SpecCounts()
        self.failures: list[tuple[str, str, Exception]] = []  # requests failed alone, for the loop to count (fail)

    # -- admission ---------------------------------------------------------------------------------------------

    def check(self, prompt_len: int, params: SamplingParams, dp_rank: int | None) -> None:
        """Refuses at once what could never run (the front end calls this before submitting)."""
        pool = self.ranks[0].blocks
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

    def check_kv(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuses what the connector cannot take (the door's threads call this)."""
        self.connector.check(prompt_ids, params, self.ranks[0].block_size)

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, on_output, dp_rank: int | None = None
            ) -> Request:
        """A new request, queued on its DP rank, or held by the connector until its blocks arrive. One that cannot
        be added raises, and what its params hold elsewhere is let go (the loop aborts what was added of it)."""
        try:
            self.check(len(prompt), params, dp_rank)
            hashes = block_hashes(prompt, self.ranks[0].block_size, params.cache_salt) if self.prefix_caching else []
            rank = self.ranks[dp_rank if dp_rank is not None else self._place(params.max_tokens, len(prompt), hashes)]
            seed = params.seed if params.seed is not None else random.getrandbits(SEED_BITS)
            request = Request(request_id, next(self._seq_ids), list(prompt), params, seed, on_output, rank.index,
                              forked=params.n == 1, hashes=hashes)
            self.requests[request.key] = self.by_seq[request.seq_id] = request
            if not self.connector.take(request, rank):
                rank.enqueue(request)
        except Exception:
            self.connector.rejected(params)
            raise
        return request

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
        usable = hashes[:(prompt_len - 1) // self.ranks[0].block_size]

        def cost(rank: DPRank) -> int:
            if self.balancing != "cache-aware" or not usable:
                return rank.load(horizon)
            return rank.load(horizon) + prompt_len - len(rank.blocks.match(usable)) * rank.block_size

        return min(self.ranks, key=lambda r: (cost(r), -r.blocks.num_free, r.index)).index

    @property
    def has_work(self) -> bool:
        return any(r.waiting or r.running for r in self.ranks) or self.connector.has_step_work

    @property
    def holding(self) -> bool:
        """The connector holds requests outside the queues (their blocks are on their way)."""
        return self.connector.holding

    # -- one step ----------------------------------------------------------------------------------------------

    def schedule(self) -> Step | None:
        """The next step's batches, or None when no DP rank has anything to do (nor to free)."""
        if not self.has_work:
            return None
        batches, started, preempted = [], [], [0] * self.dp
        shares = context_parallel.shares(self, started)
        self.cp_prefills += len({request.seq_id for _, request in shares.values()})
        for rank in self.ranks:
            releases, forks = rank.pending()
            batch = Batch(releases=releases, forks=forks)
            if rank.index in shares:  # the rank gives this step to a context-parallel prefill
                share, request = shares[rank.index]
                batch.cp, batch.input_ids = share, [request.prompt[p] for p in share.positions]
            else:
                preempted[rank.index] = self._fill(rank, batch, started)
            batches.append(batch)
        for rank, batch in zip(self.ranks, batches):  # once every rank's evictions and hits of the step are known
            batch.kv = self.connector.step_meta(rank)
            batch.validate(rank.block_size, rank.blocks.num_blocks)  # where it is built; the ranks check it again
        return Step(batches, started, preempted)

    def _fill(self, rank: DPRank, batch: Batch, started: list[Request]) -> int:
        """A rank's batch: its running requests first, preempting the newest where blocks run short, then its
        waiting ones in order, within the token budget -> the requests preempted."""
        budget, running, scheduled, preempted, pool = self.budget, rank.running, 0, 0, rank.blocks
        while scheduled < len(running) and budget > 0:
            request = running[scheduled]
            n = min(len(request.tokens) + len(self.plan.usable_drafts(request)) - request.num_computed, budget)
            while pool.missing(request.seq_id, self.plan.room(request, n)) > pool.num_free:
                self._preempt(rank.victim(scheduled), rank, batch)  # never one already scheduled
                preempted += 1
                if request not in running:
                    break
            else:
                budget -= self._feed(batch, rank, request, n)
                scheduled += 1
        waiting = rank.waiting
        while waiting and budget > 0 and rank.seqs() + waiting[0].seqs <= self.max_num_seqs:
            request = waiting[0]
            if not self._reuse_prefix(rank, request):
                break  # its prefix is being read from disk: it starts next step
            n = min(len(request.tokens) - request.num_computed, budget)
            if pool.missing(request.seq_id, self.plan.room(request, n)) > pool.num_free:
                break  # arrival order: nobody overtakes the first waiting request
            running.append(waiting.popleft())
            self._started(request, started)
            budget -= self._feed(batch, rank, request, n)
        return preempted

    @staticmethod
    def _started(request: Request, started: list[Request]) -> None:
        if request.first_scheduled is None:
            request.first_scheduled = time.perf_counter()
            started.append(request)

    def _reuse_prefix(self, rank: DPRank, request: Request) -> bool:
        """A request about to be admitted with nothing computed and no table yet starts from its longest published
        prefix of full blocks (the device pool's, extended by the connector's), its last token always left to
        compute -> False when the connector is still fetching part of it (the request waits a step)."""
        pool = rank.blocks
        if not self.prefix_caching or request.num_computed or request.seq_id in pool.tables or request.scoring:
            return True
        tokens = request.tokens
        request.hashes = block_hashes(tokens, pool.block_size, request.params.cache_salt, request.hashes)
        usable = request.hashes[:(len(tokens) - 1) // pool.block_size]
        blocks = pool.match(usable)
        blocks = self.connector.hit(request, rank, usable, blocks)
        if blocks is None:
            return False
        self.prefix_queries += len(tokens)
        self.prefix_hits += len(blocks) * pool.block_size
        # its table starts now, empty without a hit: a request that waits on is looked up (and counted) once
        if request.seq_id not in pool.tables:
            pool.adopt(request.seq_id, blocks)
        request.num_computed = len(blocks) * pool.block_size
        if request.first_scheduled is None:
            request.cached_tokens = request.num_computed
        return True

    def _publish(self) -> None:
        """After a step: every running sequence's full blocks that the step completed, published in its pool."""
        for rank in self.ranks:
            size = rank.block_size
            for request in rank.running:
                full = request.num_computed // size
                if full > request.published and request.seq_id in rank.blocks.tables:
                    request.hashes = block_hashes(request.tokens[:full * size], size, request.params.cache_salt,
                                                  request.hashes[:full])
                    rank.publish(request.seq_id, request.hashes[:full])
                    request.published = full

    def _feed(self, batch: Batch, rank: DPRank, request: Request, n: int) -> int:
        start, stop, known = request.num_computed, request.num_computed + n, len(request.tokens)
        drafts = self.plan.usable_drafts(request)[:max(0, stop - known)]  # fed after its last token, when decoding
        table = rank.blocks.grow(request.seq_id, self.plan.room(request, stop - start))
        sample = self.plan.spec(request, drafts) if stop >= known else None
        follow = request.tokens[stop] if self.plan.speculative_tokens and stop < known else None
        params = request.params
        scores = None
        if request.scoring:  # rows start .. predict prompt tokens start + 1 ..
            targets = request.prompt[start + 1:min(stop, len(request.prompt) - 1) + 1]
            scores = PromptScores(targets, params.prompt_logprobs) if targets else None
        state = rank.hold_state(request.seq_id, start, stop)
        if request.restore is not None:
            batch.restores.append(request.restore)
            self._restored.append((rank, request.seq_id))
            request.restore = None
        batch.add(request.seq_id, (request.tokens + drafts)[start:stop], stop, table, rank.block_size, sample, scores,
                  state, follow)
        request.num_computed, request.verifying, request.drafts = stop, len(drafts), []
        return stop - start

    def _preempt(self, request: Request, rank: DPRank, batch: Batch) -> None:
        self.preemptions += 1
        request.drafts = []
        rank.free(request.seq_id, batch.releases)
        request.num_computed = request.published = 0
        if request.scoring:
            request.prompt_logprobs = []  # a partly scored prompt is scored again from the start
        rank.enqueue(request, front=True)

    # -- results -----------------------------------------------------------------------------------------------

    def update(self, step: Step, results: list[list[SeqResult]]) -> list[tuple[Request, RequestOutput]]:
        """results[rank][i]: the i-th sequence of that rank's batch -> the outputs to deliver (finished requests
        are freed here; engine/step_results.py)."""
        return step_results.update(self, step, results)

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
        del self.requests[request.key], self.by_seq[request.seq_id]
        self.connector.removed(request)
        self.ranks[request.dp_rank].drop(request)
        self.ranks[request.dp_rank].free(request.seq_id)

    # -- the connector's events (engine/kv_connector/) --------------------------------------------------------------

    def reported(self, reports: list) -> list[tuple[Request, RequestOutput]]:
        """Every rank's connector reports of the step, before its results are taken -> outputs of requests that
        fail."""
        return self._apply(self.connector.reported(reports, self.ranks))

    def poll(self, now: float) -> tuple[list[tuple[Request, RequestOutput]], float | None, bool]:
        """The loop's turn for the connector -> (outputs of requests that fail, seconds until it wants the next
        turn (None: no hurry), whether anything the metrics show changed)."""
        events, wait = self.connector.poll(now, self.ranks)
        return self._apply(events), wait, bool(events.changed or events.ready or events.failed)

    def _apply(self, events: Events) -> list[tuple[Request, RequestOutput]]:
        """Requests the connector held: those ready queued on their DP rank, those that failed ended with its
        error."""
        for request in events.ready:
            self.ranks[request.dp_rank].enqueue(request)
        outputs = []
        for request, error in events.failed:
            self._remove(request)
            outputs += [(request, RequestOutput(request.request_id, len(request.prompt), index=i, finished=True,
                                                finish_reason=FINISH_ABORT, error=error))
                        for i in range(request.params.n)]
        return outputs
