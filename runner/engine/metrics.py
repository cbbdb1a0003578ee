"""`dsrun serve`'s Prometheus metrics, with the meanings of vLLM's (whose names users' dashboards know) under a
`dsrun:` prefix; the `engine` label is the attention-DP rank."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# latency buckets in seconds: tiny CPU models answer in milliseconds, real ones in seconds
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
# max over mean of the tokens the DP ranks feed in one step: 1 is perfect balance, dp is one rank doing everything
IMBALANCE_BUCKETS = (1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)


class ServeMetrics:
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
        self.steps = Counter("dsrun:engine_steps", "Engine steps run", per_model, registry=registry)
        self.cp_prefills = Counter("dsrun:context_parallel_prefills", "Prompts prefilled by a context-parallel "
                                   "group (--prefill-context-parallel-size)", per_model, registry=registry)
        self.prefix_queries = Counter("dsrun:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      per_model, registry=registry)
        self.prefix_hits = Counter("dsrun:prefix_cache_hits", "Prompt tokens found in the prefix cache (their entries "
                                   "reused, not computed)", per_model, registry=registry)
        self.cp_prefill_tokens = Counter("dsrun:context_parallel_prefill_tokens", "Prompt tokens prefilled by "
                                         "context-parallel groups", per_model, registry=registry)
        # speculative decoding, vLLM's meanings: verification steps with drafts, their draft tokens, the accepted
        # ones, and the accepted ones per draft position (label `position`, from 0)
        self.spec_drafts = Counter("dsrun:spec_decode_num_drafts", "Verification steps with drafts", per_model,
                                   registry=registry)
        self.spec_draft_tokens = Counter("dsrun:spec_decode_num_draft_tokens", "Draft tokens verified", per_model,
                                         registry=registry)
        self.spec_accepted = Counter("dsrun:spec_decode_num_accepted_tokens", "Draft tokens accepted", per_model,
                                     registry=registry)
        self.spec_accepted_per_pos = Counter("dsrun:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each draft position", per_model + ["position"],
                                             registry=registry)

        def histogram(name, doc, buckets=LATENCY_BUCKETS):
            return Histogram(name, doc, per_model, buckets=buckets, registry=registry)

        self.ttft = histogram("dsrun:time_to_first_token_seconds", "Arrival to first token")
        self.itl = histogram("dsrun:inter_token_latency_seconds", "Between consecutive tokens of a request")
        self.e2e = histogram("dsrun:e2e_request_latency_seconds", "Arrival to finish")
        self.queue = histogram("dsrun:request_queue_time_seconds", "Arrival to first scheduled")
        self.imbalance = histogram("dsrun:dp_imbalance", "Per busy step: max over mean of the DP ranks' tokens",
                                   IMBALANCE_BUCKETS)
        for counter in (self.prefix_queries, self.prefix_hits):  # from the start, at 0
            counter.labels(model_name)
        for rank in range(dp):  # every rank's series exists from the start, at 0
            for gauge in (self.running, self.waiting, self.kv_usage, self.preemptions, self.zero_token_steps):
                gauge.labels(model_name, str(rank))

    def rank(self, metric, rank: int):
        return metric.labels(self.model_name, str(rank))

    def model(self, metric, *labels: str):
        return metric.labels(self.model_name, *labels)
