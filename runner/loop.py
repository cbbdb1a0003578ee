"""The engine's step loop, shared by `dsrun serve`, `dsrun generate` and in-process generation.

Rank 0 schedules (scheduler.py) and sends every rank the step's batches; each rank runs its attention-DP
index's batch through the model (a DP rank with nothing to do runs a zero-token step, so every rank enters the
MoE and lm_head collectives of the step), samples, and the attention-TP rank 0 of every DP index sends its
sequences' tokens back to rank 0. When no rank has work, rank 0 waits for requests without running any
collective; it only sends a keep-alive message often enough that no waiting rank's collective times out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dsconv.runner.batch import Batch
from dsconv.runner.metrics import ServeMetrics
from dsconv.runner.sampling import log_probs, sample, token_logprob
from dsconv.runner.scheduler import Scheduler, Step


@dataclass(frozen=True)
class Plan:
    """What rank 0 sends every rank each round: the step's batches (one per DP index), or nothing to run (a
    keep-alive), or the end of the loop."""
    batches: list[Batch] | None = None
    stop: bool = False


class Worker:
    """One rank's side of a step: its DP index's batch through the model and the sampler."""

    def __init__(self, model, cache, dist, dp_index: int):
        self.model, self.cache, self.dist, self.dp_index = model, cache, dist, dp_index
        self.reports = dist.attn_tp_rank == 0  # attention-TP ranks of one DP index compute the same rows

    @torch.inference_mode()
    def execute(self, batch: Batch) -> list[tuple] | None:
        """-> per sequence (sampled token | None, its TokenLogprob | None, scored prompt TokenLogprobs), from the
        reporting rank of the DP index (None from the others)."""
        batch.validate(self.cache.block_size, self.cache.num_blocks)  # as received, before anything is written
        self.dist.steps += 1
        for seq_id in batch.releases:  # finished, aborted or preempted since the last step
            self.cache.release(seq_id)
        meta = self.cache.begin(batch)
        device = meta.positions.device
        tokens = torch.tensor(batch.input_ids, dtype=torch.long, device=device)
        rows = batch.logit_rows()
        every_row = rows == list(range(batch.num_tokens))
        logits = self.model.forward(tokens, meta, self.cache,
                                    rows=None if every_row else torch.tensor(rows, dtype=torch.long, device=device))
        if not self.reports:
            return None
        results, at = [], 0
        for scores, spec in zip(batch.scores, batch.samples):
            n_scored = len(scores.targets) if scores is not None else 0
            seq_logits = logits[at:at + n_scored + (spec is not None)]
            at += seq_logits.shape[0]
            wants_logprobs = scores is not None or (spec is not None and spec.logprobs is not None)
            logp = log_probs(seq_logits) if wants_logprobs else None
            scored = [token_logprob(logp[j], t, scores.top) for j, t in enumerate(scores.targets)] if n_scored else []
            token = logprob = None
            if spec is not None:
                token = sample(seq_logits[-1], spec)
                if spec.logprobs is not None:
                    logprob = token_logprob(logp[-1], token, spec.logprobs)
            results.append((token, logprob, scored))
        return results


class EngineCore:
    """Rank 0's step: schedule, run on every rank, collect the tokens, update the requests."""

    def __init__(self, scheduler: Scheduler, worker: Worker, world_size: int = 1, attn_tp: int = 1,
                 metrics: ServeMetrics | None = None):
        self.scheduler, self.worker, self.metrics = scheduler, worker, metrics
        self.world_size, self.attn_tp = world_size, attn_tp

    def step(self) -> list[tuple]:
        """One step -> (request, output) pairs to deliver; [] when there was nothing to run."""
        step = self.scheduler.schedule()
        if step is None:
            return []
        results = self._run(step.batches)
        outputs = self.scheduler.update(step, results)
        if self.metrics is not None:
            self._record(step, outputs)
        return outputs

    def _run(self, batches: list[Batch]) -> list[list[tuple]]:
        if self.world_size == 1:
            return [self.worker.execute(batches[0])]
        _send(Plan(batches))
        mine = self.worker.execute(batches[self.worker.dp_index])
        everyone = [None] * self.world_size
        torch.distributed.gather_object(mine, everyone, dst=0)
        return [everyone[dp_index * self.attn_tp] for dp_index in range(len(batches))]  # each index's reporter

    def keepalive(self) -> None:
        if self.world_size > 1:
            _send(Plan())

    def stop(self) -> None:
        if self.world_size > 1:
            _send(Plan(stop=True))

    def record_queues(self) -> None:
        """The running / waiting / KV gauges, after a step and after requests come or go between steps."""
        m, s = self.metrics, self.scheduler
        if m is None:
            return
        for rank in range(s.dp):
            m.rank(m.running, rank).set(len(s.running[rank]))
            m.rank(m.waiting, rank).set(len(s.waiting[rank]))
            m.rank(m.kv_usage, rank).set(s.pools[rank].used_fraction)

    def _record(self, step: Step, outputs: list[tuple]) -> None:
        m, now = self.metrics, time.perf_counter()
        m.model(m.steps).inc()
        tokens = [b.num_tokens for b in step.batches]
        if any(tokens):  # a busy step: its balance, and the ranks that only joined the collectives
            m.model(m.imbalance).observe(max(tokens) * len(tokens) / sum(tokens))
            for rank, count in enumerate(tokens):
                if not count:
                    m.rank(m.zero_token_steps, rank).inc()
        self.record_queues()
        for rank, count in enumerate(step.preempted):
            if count:
                m.rank(m.preemptions, rank).inc(count)
        for request in step.started:
            m.model(m.prompt_tokens).inc(len(request.prompt))
            m.model(m.queue).observe(request.first_scheduled - request.arrival)
        for request, out in outputs:
            if out.new_token_ids:
                m.model(m.generation_tokens).inc(len(out.new_token_ids))
                if len(request.output) == 1:
                    m.model(m.ttft).observe(now - request.arrival)
                elif request.previous_token is not None:
                    m.model(m.itl).observe(now - request.previous_token)
            if out.finished:
                m.model(m.success, out.finish_reason).inc()
                m.model(m.e2e).observe(now - request.arrival)


def _send(plan: Plan) -> None:
    message = [plan]
    torch.distributed.broadcast_object_list(message, src=0)


def follow(worker: Worker) -> None:
    """Ranks other than 0: run the steps rank 0 sends until it says stop."""
    while True:
        message = [None]
        torch.distributed.broadcast_object_list(message, src=0)
        plan: Plan = message[0]
        if plan.stop:
            return
        if plan.batches is None:  # keep-alive
            continue
        mine = worker.execute(plan.batches[worker.dp_index])
        torch.distributed.gather_object(mine, None, dst=0)
