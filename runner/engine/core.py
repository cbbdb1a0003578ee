"""The engine's step loop, shared by `dsrun serve`, `dsrun generate`, `dsrun perplexity` and in-process generation.

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

from dsconv.runner.models.batch import Batch
from dsconv.runner.engine.metrics import ServeMetrics
from dsconv.runner.engine.request import SeqResult
from dsconv.runner.engine.scheduler import Scheduler, Step
from dsconv.runner.engine.worker import Worker


@dataclass(frozen=True)
class Plan:
    """What rank 0 sends every rank each round: the step's batches (one per DP index), or nothing to run (a
    keep-alive), or the end of the loop."""
    batches: list[Batch] | None = None
    stop: bool = False


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

    def _run(self, batches: list[Batch]) -> list[list[SeqResult]]:
        """-> per DP index, one result per sequence of its batch."""
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
        for batch in step.batches:
            if batch.cp is not None and batch.cp.member == 0:  # once per prefill, by its owner
                m.model(m.cp_prefills).inc()
                m.model(m.cp_prefill_tokens).inc(batch.cp.length)
        for request in step.started:
            m.model(m.prompt_tokens).inc(len(request.prompt))
            m.model(m.queue).observe(request.first_scheduled - request.arrival)
        for request, out in outputs:
            if out.new_token_ids:
                m.model(m.generation_tokens).inc(len(out.new_token_ids))
                if len(request.output) == 1 and request.index == 0:  # n > 1: drawn together, counted once
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
