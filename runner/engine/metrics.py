"""`dsrun serve`'s Prometheus metrics, with the meanings of vLLM's (whose names users' dashboards know) under a
`dsrun:` prefix; the `engine` label is the attention-DP rank."""

from __future__ import annotations

import copy
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dsconv.runner.engine.kv_connector.offload import OffloadConnector
from dsconv.runner.engine.kv_connector.pd import ConsumerConnector, ProducerConnector
from dsconv.runner.engine.kv_offload import OffloadCounts
from dsconv.runner.engine.kv_transfer import LoadReport
from dsconv.runner.engine.speculative import SpecCounts

# latency buckets in seconds: tiny CPU models answer in milliseconds, real ones in seconds
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
# max over mean of the tokens the DP ranks feed in one step: 1 is perfect balance, dp is one rank doing everything
IMBALANCE_BUCKETS = (1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)


class ServeMetrics:
    """The metrics and what the engine's loop reports into them (record_queues, record_step)."""

    def __init__(self, model_name: str, dp: int):
        self.registry = CollectorRegistry()
        self.model_name, self.dp = model_name, dp
        per_rank, per_model = ["model_name", "engine"], ["model_name"]
        registry = self.registry
        self.running = Gauge("dsrun:num_requests_running", "Requests in the running batch", per_rank, registry=registry)
        self.waiting = Gauge("dsrun:num_requests_waiting", "Requests waiting (new or preempted)", per_rank,
                             registry=registry)
        self.kv_usage = Gauge("dsrun:kv_cache_usage_perc", "Fraction of the KV cache blocks in use (0 to 1)", per_rank,
                              registry=registry)
        self.prompt_tokens = Counter("dsrun:prompt_tokens", "Prompt tokens of admitted requests", per_model,
                                     registry=registry)
        self.generation_tokens = Counter("dsrun:generation_tokens", "Generated tokens", per_model, registry=registry)
        self.success = Counter("dsrun:request_success", "Finished requests by finish reason",
                               per_model + ["finished_reason"], registry=registry)
        self.preemptions = Counter("dsrun:num_preemptions", "Requests preempted for KV cache room (recomputed later)",
                                   per_rank, registry=registry)
        self.zero_token_steps = Counter("dsrun:zero_token_steps", "Steps a DP rank ran with no tokens while another "
                                        "rank had work (it still joins the MoE exchanges)", per_rank, registry=registry)
        self._engine_metrics(per_model)
        self.cp_prefills = Counter("dsrun:context_parallel_prefills", "Prompts prefilled by a context-parallel "
                                   "group (--prefill-context-parallel-size)", per_model, registry=registry)
        self.prefix_queries = Counter("dsrun:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      per_model, registry=registry)
        self.prefix_hits = Counter("dsrun:prefix_cache_hits", "Prompt tokens found in the prefix cache (their entries "
                                   "reused, not computed)", per_model, registry=registry)
        self.cp_prefill_tokens = Counter("dsrun:context_parallel_prefill_tokens", "Prompt tokens prefilled by "
                                         "context-parallel groups", per_model, registry=registry)
        self._speculative_metrics(per_model)
        self._transfer_metrics(per_model)
        self._eplb_metrics(per_model)
        self._offload_metrics(per_model)
        self._transfer_seen = (0, 0, 0)  # the scheduler's failed loads, expired leases, received tokens counted
        self._prefix_seen = (0, 0)  # the scheduler's prefix-cache counts already counted
        self._spec_seen = SpecCounts()  # and its speculative-decoding counts

        def histogram(name, doc, buckets=LATENCY_BUCKETS):
            return Histogram(name, doc, per_model, buckets=buckets, registry=registry)

        self.ttft = histogram("dsrun:time_to_first_token_seconds", "Arrival to first token")
        self.itl = histogram("dsrun:inter_token_latency_seconds", "Between consecutive tokens of a request")
        self.e2e = histogram("dsrun:e2e_request_latency_seconds", "Arrival to finish")
        self.queue = histogram("dsrun:request_queue_time_seconds", "Arrival to first scheduled")
        self.imbalance = histogram("dsrun:dp_imbalance", "Per busy step: max over mean of the DP ranks' tokens",
                                   IMBALANCE_BUCKETS)
        for counter in (self.prefix_queries, self.prefix_hits, self.kv_transfer_bytes, self.kv_transfer_failures,
                        self.kv_transfer_leases, self.kv_transfer_expired, self.kv_transfer_tokens):  # from the start
            counter.labels(model_name)
        for rank in range(dp):  # every rank's series exists from the start, at 0
            for gauge in (self.running, self.waiting, self.kv_usage, self.preemptions, self.zero_token_steps):
                gauge.labels(model_name, str(rank))

    def _speculative_metrics(self, per_model: list[str]) -> None:
        """Speculative decoding, vLLM's meanings: verification steps with drafts, their draft tokens, the accepted
        ones, and the accepted ones per draft position (label `position`, from 0)."""
        registry = self.registry
        self.spec_drafts = Counter("dsrun:spec_decode_num_drafts", "Verification steps with drafts", per_model,
                                   registry=registry)
        self.spec_draft_tokens = Counter("dsrun:spec_decode_num_draft_tokens", "Draft tokens verified", per_model,
                                         registry=registry)
        self.spec_accepted = Counter("dsrun:spec_decode_num_accepted_tokens", "Draft tokens accepted", per_model,
                                     registry=registry)
        self.spec_accepted_per_pos = Counter("dsrun:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each draft position", per_model + ["position"],
                                             registry=registry)

    def _transfer_metrics(self, per_model: list[str]) -> None:
        """P/D disaggregation (engine/kv_transfer.py): a consumer's reads, a producer's leases."""
        registry = self.registry
        self.kv_transfer_bytes = Counter("dsrun:kv_transfer_bytes", "KV cache bytes read from producers (every rank's "
                                         "reads)", per_model, registry=registry)
        self.kv_transfer_failures = Counter("dsrun:kv_transfer_failures", "Hand-overs whose read failed or timed out",
                                            per_model, registry=registry)
        self.kv_transfer_leases = Gauge("dsrun:kv_transfer_leases", "Hand-overs whose blocks a producer holds for "
                                        "its consumer", per_model, registry=registry)
        self.kv_transfer_expired = Counter("dsrun:kv_transfer_leases_expired", "Leases a producer ended unconfirmed",
                                           per_model, registry=registry)
        self.kv_transfer_tokens = Counter("dsrun:kv_transfer_received_tokens", "Prompt tokens whose KV cache a "
                                          "consumer received from a producer (not computed)", per_model,
                                          registry=registry)
        self.kv_transfer_seconds = Histogram("dsrun:kv_transfer_seconds", "One rank's read of one hand-over",
                                             per_model, buckets=LATENCY_BUCKETS, registry=registry)

    def _engine_metrics(self, per_model: list[str]) -> None:
        """The loop's steps, and the requests it failed alone (request.FAILURE_STAGES) while it went on."""
        self.steps = Counter("dsrun:engine_steps", "Engine steps run", per_model, registry=self.registry)
        self.request_failures = Counter("dsrun:request_failures", "Requests failed by an error of their own, by "
                                        "stage (the server went on)", per_model + ["stage"], registry=self.registry)

    def _eplb_metrics(self, per_model: list[str]) -> None:
        """EPLB (runner/models/eplb.py): each rebalance's balancedness, per layer (label `layer`, "all" overall),
        measured over the window before it and planned for the new placement (label `stage`)."""
        self.eplb_balancedness = Gauge("dsrun:eplb_balancedness", "Mean over max of the tokens per EP rank at the "
                                       "last EPLB rebalance, measured over its window or planned",
                                       per_model + ["layer", "stage"], registry=self.registry)
        self.eplb_rebalances = Counter("dsrun:eplb_rebalances", "EPLB rebalances run", per_model,
                                       registry=self.registry)
        self.eplb_rebalances.labels(self.model_name)  # from the start, at 0
        self.eplb_skipped = Counter("dsrun:eplb_rebalances_skipped", "EPLB rebalances not run: they fell due while "
                                    "the last one's experts were still moving", per_model, registry=self.registry)
        self.eplb_skipped.labels(self.model_name)
        self._eplb_seen = (0, 0)  # the balancer's rebalances and skipped ones already counted

    def rank(self, metric, rank: int):
        return metric.labels(self.model_name, str(rank))

    def _offload_metrics(self, per_model: list[str]) -> None:
        """KV offload (engine/kv_offload.py): hits and evictions per tier, bytes moved each way, corrupt files."""
        registry = self.registry
        self.offload_hits = Counter("dsrun:kv_offload_hit_tokens", "Prompt tokens whose entries a prefix hit took "
                                    "from each tier (device, host, disk)", per_model + ["tier"], registry=registry)
        self.offload_bytes = Counter("dsrun:kv_offload_bytes", "Bytes the KV offload tiers moved, each way "
                                     "(device_to_host, host_to_device, host_to_disk, disk_to_host; every rank)",
                                     per_model + ["direction"], registry=registry)
        self.offload_evictions = Counter("dsrun:kv_offload_evictions", "Blocks each tier gave up (device: to the "
                                         "host tier; host: to the disk tier, or lost; disk: files removed)",
                                         per_model + ["tier"], registry=registry)
        self.offload_corrupt = Counter("dsrun:kv_offload_corrupt_files", "Disk tier files found torn, corrupt or "
                                       "another run's (skipped and removed; every rank)", per_model, registry=registry)
        self.offload_disk_errors = Counter("dsrun:kv_offload_disk_errors", "Errors the filesystem gave the disk tier "
                                           "(every rank), by errno name; the first stops its writes", per_model
                                           + ["errno"], registry=registry)
        self.offload_disk_stopped = Gauge("dsrun:kv_offload_disk_stopped", "1 when the disk tier takes no more blocks "
                                          "(a filesystem error: /health says which), else 0", per_model,
                                          registry=registry)
        self._offload_seen = OffloadCounts()

    def record_connector(self, connector, reports: list) -> None:
        """After a step: the KV connectors' figures (connector: the scheduler's; reports: every rank's of the step)."""
        self.record_loads([report for report in reports if isinstance(report, LoadReport)])
        self.record_offload(connector.find(OffloadConnector))

    def record_offload(self, offload) -> None:
        """KV offload's totals (kv_connector.offload.OffloadConnector's counts, kv_offload.OffloadCounts): what
        grew since the last step. None: no offload."""
        if offload is None:
            return
        now, seen = offload.counts, self._offload_seen
        for metric, current, before in ((self.offload_hits, now.hit_tokens, seen.hit_tokens),
                                        (self.offload_bytes, now.moved, seen.moved),
                                        (self.offload_evictions, now.evictions, seen.evictions)):
            for label, count in current.items():
                if count > before[label]:
                    self.model(metric, label).inc(count - before[label])
        if now.corrupt_files > seen.corrupt_files:
            self.model(self.offload_corrupt).inc(now.corrupt_files - seen.corrupt_files)
        for name, count in now.disk_errors.items():
            if count > seen.disk_errors.get(name, 0):
                self.model(self.offload_disk_errors, name).inc(count - seen.disk_errors.get(name, 0))
        self.model(self.offload_disk_stopped).set(now.disk_stopped is not None)
        self._offload_seen = copy.deepcopy(now)

    def model(self, metric, *labels: str):
        return metric.labels(self.model_name, *labels)

    # -- what the engine's loop reports (engine/core.py) ---------------------------------------------------------

    def record_queues(self, scheduler) -> None:
        """The running / waiting / KV gauges, after a step and after requests come or go between steps."""
        for rank in scheduler.ranks:
            self.rank(self.running, rank.index).set(len(rank.running))
            self.rank(self.waiting, rank.index).set(len(rank.waiting))
            self.rank(self.kv_usage, rank.index).set(rank.blocks.used_fraction)
        producer = scheduler.connector.find(ProducerConnector)
        consumer = scheduler.connector.find(ConsumerConnector)
        self.model(self.kv_transfer_leases).set(len(producer.leases) if producer is not None else 0)
        now = (consumer.load_failures if consumer is not None else 0,
               producer.leases_expired if producer is not None else 0,
               consumer.received_tokens if consumer is not None else 0)
        for metric, count, seen in zip((self.kv_transfer_failures, self.kv_transfer_expired, self.kv_transfer_tokens),
                                       now, self._transfer_seen):
            self.model(metric).inc(count - seen)
        self._transfer_seen = now

    def record_eplb(self, balancer) -> None:
        """A rebalance since the last call: its figures (balancer: runner.models.eplb.ExpertBalancer or None)."""
        if balancer is None or (balancer.rebalances, balancer.skipped) == self._eplb_seen:
            return
        self.model(self.eplb_skipped).inc(balancer.skipped - self._eplb_seen[1])
        rebalanced, self._eplb_seen = balancer.rebalances - self._eplb_seen[0], (balancer.rebalances, balancer.skipped)
        if not rebalanced:
            return
        self.model(self.eplb_rebalances).inc(rebalanced)
        for stage, figures in (("measured", balancer.figures.measured), ("planned", balancer.figures.planned)):
            for layer, value in figures.items():
                self.eplb_balancedness.labels(self.model_name, layer, stage).set(value)

    def record_loads(self, reports: list) -> None:
        """The ranks' reports of one step's hand-over reads (kv_transfer.LoadReport)."""
        for report in reports:
            self.model(self.kv_transfer_bytes).inc(report.bytes)
            self.model(self.kv_transfer_seconds).observe(report.seconds)

    def record_step(self, scheduler, step, outputs: list[tuple]) -> None:
        """One step of the scheduler's (a scheduler.Step) and the (request, output) pairs it delivered."""
        now = time.perf_counter()
        self.model(self.steps).inc()
        tokens = [b.num_tokens for b in step.batches]
        if any(tokens):  # a busy step: its balance, and the ranks that only joined the collectives
            self.model(self.imbalance).observe(max(tokens) * len(tokens) / sum(tokens))
            for rank, count in enumerate(tokens):
                if not count:
                    self.rank(self.zero_token_steps, rank).inc()
        self.record_queues(scheduler)
        for rank, count in enumerate(step.preempted):
            if count:
                self.rank(self.preemptions, rank).inc(count)
        for batch in step.batches:
            if batch.cp is not None and batch.cp.member == 0:  # once per prefill, by its owner
                self.model(self.cp_prefills).inc()
                self.model(self.cp_prefill_tokens).inc(batch.cp.length - batch.cp.start)
        self._record_totals(scheduler)
        for request in step.started:
            self.model(self.prompt_tokens).inc(len(request.prompt))
            self.model(self.queue).observe(request.first_scheduled - request.arrival)
        for request, out in outputs:
            self._record_output(request, out, now)

    def _record_totals(self, scheduler) -> None:
        """The scheduler's running totals (prefix cache, speculative decoding) as counters: what grew since the
        last step."""
        queries, hits = scheduler.prefix_queries, scheduler.prefix_hits
        self.model(self.prefix_queries).inc(queries - self._prefix_seen[0])
        self.model(self.prefix_hits).inc(hits - self._prefix_seen[1])
        self._prefix_seen = (queries, hits)
        spec, seen = scheduler.spec, self._spec_seen
        if spec.drafts <= seen.drafts:
            return
        for metric, now, before in ((self.spec_drafts, spec.drafts, seen.drafts),
                                    (self.spec_draft_tokens, spec.draft_tokens, seen.draft_tokens),
                                    (self.spec_accepted, spec.accepted_tokens, seen.accepted_tokens)):
            self.model(metric).inc(now - before)
        before = seen.accepted_per_pos or [0] * len(spec.accepted_per_pos)
        for position, (count, was) in enumerate(zip(spec.accepted_per_pos, before, strict=True)):
            self.model(self.spec_accepted_per_pos, str(position)).inc(count - was)
        self._spec_seen = spec.copy()

    def _record_output(self, request, out, now: float) -> None:
        if out.new_token_ids:
            self.model(self.generation_tokens).inc(len(out.new_token_ids))
            if len(request.output) == 1 and request.index == 0:  # n > 1: drawn together, counted once
                self.model(self.ttft).observe(now - request.arrival)
            elif request.previous_token is not None:
                self.model(self.itl).observe(now - request.previous_token)
        if out.finished:
            self.model(self.success, out.finish_reason).inc()
            self.model(self.e2e).observe(now - request.arrival)
