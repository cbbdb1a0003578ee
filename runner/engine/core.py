"""The engine, built in one function (`new_engine`; `start_engine` loads a rank's model first) and the owner of
the step loop, shared by `dsrun serve`, `dsrun generate`, `dsrun perplexity`, the benchmarks and the tests.

Rank 0 runs the loop (`EngineCore.run`): it takes requests from its door (`EngineClient`), schedules (scheduler.py)
and sends every rank the step's batches; each rank runs its attention-DP index's batch through the model
(worker.py; a DP rank with nothing to do runs a zero-token step, so every rank enters the MoE and lm_head
collectives of the step), samples, and the attention-TP rank 0 of every DP index sends its sequences' tokens
back to rank 0. The other ranks follow rank 0's plans until it says stop. When no rank has work, rank 0 waits
for requests without running any collective; it only sends a keep-alive often enough that no waiting rank's
collective times out.

The door: requests come in from any thread (the HTTP server's, or `dsrun generate`'s list of prompts) and wait on a
queue for the loop, which runs in rank 0's main thread, the only one that enters collectives. `submit` checks a
request against what never changes (vocabulary, lengths, cache size) and answers at once; the loop picks it up
before its next step and places it on a DP rank. Outputs go to each request's callback from the loop's thread. The
door exists before the engine does (a server answers 503 while the model loads); the engine opens it once loaded.
"""

from __future__ import annotations

import pickle
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from dsconv.comm.collectives import broadcast_bytes, gather_bytes
from dsconv.runner.engine.config import EngineConfig, RunConfig
from dsconv.runner.engine.grammar import Grammars
from dsconv.runner.engine.kv_connector import factory
from dsconv.runner.engine.kv_connector.base import KVConnector, KVConnectorWorker, StepMeta
from dsconv.runner.engine.metrics import ServeMetrics
from dsconv.runner.engine.request import (FINISH_ABORT, NotAccepting, RequestOutput, SamplingParams, SeqResult,
                                          check_prompt, failure_text)
from dsconv.runner.engine.scheduler import PoolShape, Scheduler
from dsconv.runner.engine.shapes import ShapeRecorder
from dsconv.runner.engine.worker import Worker
from dsconv.runner.engine.batch import Batch
from dsconv.family.expert_map import ModelKey
from dsconv.runner.models.eplb import ExpertBalancer
from dsconv.runner.models.dist import Dist
from dsconv.runner.models.kernel_switch import KernelSwitch
from dsconv.runner.models.registry import DTYPES, build_model


class EngineClient:
    """The engine's door on rank 0 (the module's docstring says how requests pass it)."""

    def __init__(self):
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ready, self._draining = threading.Event(), threading.Event()
        self._check = None  # the engine's admission check, once open
        self.max_model_len: int | None = None  # the engine's, once open
        self.connector = KVConnector()  # the engine's (rank 0's side), once open: /health and its routes ask it

    # -- any thread ------------------------------------------------------------------------------------------

    def is_ready(self) -> bool:
        return self._ready.is_set() and not self._draining.is_set()

    def accepting(self) -> bool:
        return not self._draining.is_set()

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_output: Callable[[RequestOutput], None],
               dp_rank: int | None = None) -> str:
        if not self.accepting():
            raise NotAccepting("the server is shutting down")
        if not self._ready.is_set():
            raise NotAccepting("the model is still loading")
        self._check(prompt_ids, params, dp_rank)
        request_id = uuid.uuid4().hex
        self._commands.put(("add", request_id, list(prompt_ids), params, on_output, dp_rank))
        return request_id

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Ends sample `index` of the request, or all of its samples."""
        self._commands.put(("abort", request_id, index))

    def wake(self) -> None:
        """The loop's next turn comes now (something it polls has changed: a KV connector's state, say)."""
        self._commands.put(("wake",))

    def drain(self) -> None:
        """Stop admitting; the loop finishes what is in flight (aborting it after its drain timeout) and ends."""
        self._draining.set()
        self._commands.put(("wake",))

    # -- the engine's side -----------------------------------------------------------------------------------

    def open(self, engine: EngineCore) -> None:
        """Admit requests to `engine` (rank 0's, loaded)."""
        self._check, self.max_model_len, self.connector = engine.check, engine.max_model_len, engine.connector
        self._ready.set()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def pending(self) -> Iterator[tuple]:
        """The commands waiting now, oldest first."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def next_command(self, timeout: float | None) -> tuple:
        """The next command, waiting up to `timeout` seconds (queue.Empty after that)."""
        return self._commands.get(timeout=timeout)


# The step plan and the results travel pickled, in blocks of these many bytes with their length in a header: one
# collective each per step (comm.collectives: broadcast_bytes, gather_bytes), a second only for a longer one.
# A decode step's plan for 16 DP indices of 16 sequences, with block tables of a few thousand tokens, fits; a rank's
# results are a few hundred bytes a sequence (more with logprobs).
PLAN_BYTES = 64 * 2**10
RESULT_BYTES = 8 * 2**10


@dataclass(frozen=True)
class Plan:
    """What rank 0 sends every rank each round: the step's batches (one per DP index), or nothing to run (a
    keep-alive), or the end of the loop (after a graceful end, with per DP index the KV connector's last work)."""
    batches: list[Batch] | None = None
    stop: bool = False
    last: dict[int, StepMeta] | None = None


def rank_device(device: str) -> torch.device:
    """The device this rank computes on: the launcher has already selected its accelerator (set_device)."""
    if device == "cpu":
        return torch.device("cpu")
    return torch.device(device, getattr(torch, device).current_device())  # torch.cuda / torch.npu


def start_rank(run: RunConfig):
    """On every rank, after the launcher's init_process_group: -> (Dist, model, new_cache) of this rank's shards."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    overlap = run.overlap_shared_experts
    dist = Dist.from_layout(run.layout, rank_device(run.device), run.scheduler.cp_size, overlap) \
        if torch.distributed.is_initialized() else Dist(device=rank_device(run.device), overlap_shared_experts=overlap)
    dist.kernels = KernelSwitch(run.kernels)
    model, _, new_cache = build_model(run.shards, run.manifest, rank, dist, DTYPES[run.dtype],
                                      speculative_tokens=run.speculative_tokens)
    return dist, model, new_cache


def start_engine(run: RunConfig, grammars: Grammars | None = None, metrics: ServeMetrics | None = None
                 ) -> EngineCore:
    """On every rank, after the launcher's init_process_group: this rank's model from its shards, its KV cache as
    `run.cache` asks, and the engine around them (rank 0's recording what its steps cover, with --record-shapes)."""
    dist, model, new_cache = start_rank(run)
    # every rank: the same blocks, and a sequence slot for each sequence its DP rank may run
    cache = new_cache(run.cache_tokens, run.cache.dtype, run.cache.block_size, run.scheduler.max_num_seqs,
                      run.scheduler.enable_prefix_caching)
    connector, connector_worker = factory.build_for(cache, dist, run)
    balancer = None
    if run.eplb is not None or run.expert_load_record is not None:
        experts, arch = run.manifest.get("experts") or {}, run.family.parse_config(run.model_config)
        groups = getattr(arch, "n_group", None) or 1  # V4 routes without groups
        key = ModelKey.of(run.family.name, arch.n_routed_experts, (t["name"] for t in run.manifest["tensors"]))
        balancer = ExpertBalancer(dist, key, run.eplb, run.expert_load_record, groups, experts.get("nodes", 1))
    shapes = ShapeRecorder.of(run, run.record_shapes, run.command) \
        if dist.rank == 0 and run.record_shapes is not None else None
    return new_engine(model, cache, dist, run.engine_config(cache.num_blocks * cache.block_size), grammars=grammars,
                      metrics=metrics, connector=connector, connector_worker=connector_worker, balancer=balancer,
                      shapes=shapes)


def new_engine(model, cache, dist: Dist, config: EngineConfig, *, grammars: Grammars | None = None,
               metrics: ServeMetrics | None = None, connector: KVConnector | None = None,
               connector_worker: KVConnectorWorker | None = None, balancer: ExpertBalancer | None = None,
               shapes: ShapeRecorder | None = None) -> EngineCore:
    """The one place an engine is assembled, every optional part given: this rank's worker around its model and
    cache (with its side of the KV connectors and EPLB's balancer), and on rank 0 the scheduler, whose block pools
    mirror every DP rank's cache (with the connectors' scheduler side), the metrics and the shape recorder."""
    worker = Worker(model, cache, dist, dp_index=dist.rank // dist.attn_tp, grammars=grammars,
                    speculative=config.speculative, connector=connector_worker, balancer=balancer)
    if dist.rank != 0:
        return EngineCore(worker, None, config)
    scheduler = Scheduler(config.scheduler, PoolShape.of(dist.world_size // dist.attn_tp, cache),
                          config.eos_token_id, config.speculative_tokens, connector)
    return EngineCore(worker, scheduler, config, metrics, shapes)


class EngineCore:
    """One rank's engine. On rank 0 (the one with a scheduler) `run` is the loop: requests from the door, steps on
    every rank, outputs to each request's callback. On the others `run` follows rank 0's steps."""

    def __init__(self, worker: Worker, scheduler: Scheduler | None, config: EngineConfig,
                 metrics: ServeMetrics | None = None, shapes: ShapeRecorder | None = None):
        """shapes: rank 0's, with --record-shapes: it sees every scheduled step."""
        self.worker, self.scheduler, self.config, self.metrics = worker, scheduler, config, metrics
        self.world_size, self.attn_tp = worker.dist.world_size, worker.dist.attn_tp
        self.shapes = shapes

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def connector(self) -> KVConnector:
        """Rank 0's side of the KV connectors (engine/kv_connector/): its /health parts, its summary."""
        return self.scheduler.connector

    @property
    def _host(self):
        """The process group the step plan and results travel over: the world over gloo (comm.groups)."""
        return self.worker.dist.groups.host

    @property
    def leads(self) -> bool:
        return self.scheduler is not None

    def check(self, prompt_ids: list[int], params: SamplingParams, dp_rank: int | None) -> None:
        """Refuses at once what could never run: ids outside the vocabulary, more than max_model_len tokens, more
        than a DP rank's cache or sequences. Reads only what never changes, so the door calls it from any thread."""
        check_prompt(prompt_ids, params.max_tokens, self.config.vocab_size, self.max_model_len)
        self.scheduler.check(len(prompt_ids), params, dp_rank)
        self.scheduler.check_kv(prompt_ids, params)

    # -- the loop ----------------------------------------------------------------------------------------------

    def run(self, door: EngineClient | None = None, until_idle: bool = False) -> None:
        """Rank 0: the loop, until the door is drained, or (until_idle) until every submitted request has
        finished; a loop that waits for requests sends a keep-alive every keepalive_s while idle. Other ranks:
        follow rank 0's steps until it says stop."""
        if not self.leads:
            self._follow()
            return
        scheduler, deadline, sent = self.scheduler, None, time.monotonic()  # sent: the last plan the ranks heard
        graceful = True  # the loop ended on its own (drained, or idle): the KV connector's last work runs
        try:
            while True:
                for command in door.pending():
                    self._apply(command, door)
                outputs, next_poll, changed = scheduler.poll(time.monotonic())
                for request, out in outputs:
                    _deliver(request.on_output, out)
                if self.metrics is not None and (changed or outputs):
                    self.metrics.record_queues(scheduler)
                if door.draining:
                    deadline = deadline or time.monotonic() + self.config.drain_timeout_s
                    if time.monotonic() > deadline:
                        for request_id, index in list(scheduler.requests):
                            self._apply(("abort", request_id, index), door)
                    if not scheduler.has_work and not scheduler.holding:
                        return
                if not scheduler.has_work:
                    if until_idle:
                        return
                    keepalive = self.config.keepalive_s
                    wait = keepalive if next_poll is None else min(next_poll, keepalive or next_poll)
                    try:  # idle: no collectives until a request comes, a keep-alive before any could time out
                        self._apply(door.next_command(wait), door)
                    except queue.Empty:
                        if keepalive is not None and time.monotonic() - sent >= keepalive:
                            self._send(Plan())
                            sent = time.monotonic()
                    continue
                for request, out in self.step():
                    _deliver(request.on_output, out)
        except BaseException:
            graceful = False  # a step may have stopped half way: the host slots may not hold what the index says
            raise
        finally:
            self._stop(graceful)

    def _stop(self, graceful: bool) -> None:
        """Every rank leaves the loop; after a graceful end each first runs the KV connector's last work (one that
        keeps blocks on disk writes what it holds in memory, where a restart finds it)."""
        last = None
        if graceful:
            try:
                last = self.scheduler.connector.stop()
            except Exception as exc:  # noqa: BLE001  (the ranks must hear the stop whatever the last work's plan did)
                print(f"dsrun: the KV connector's last work is not done at stop: {type(exc).__name__}: {exc}",
                      file=sys.stderr, flush=True)
        self._send(Plan(stop=True, last=last))
        self.worker.finish(None if last is None else last.get(self.worker.dp_index))
        if self.shapes is not None:
            self.shapes.flush()

    def _apply(self, command: tuple, door: EngineClient) -> None:
        kind, *args = command
        if kind == "add":
            request_id, prompt, params, on_output, dp_rank = args
            if door.draining:
                for index in range(params.n):
                    _deliver(on_output, RequestOutput(request_id, len(prompt), index=index, finished=True,
                                                      finish_reason="abort", error="the server is shutting down",
                                                      unavailable=True))
            else:
                self._add(request_id, prompt, params, on_output, dp_rank)
        elif kind == "abort":
            for request, out in self.scheduler.abort(*args):
                _deliver(request.on_output, out)
        if self.metrics is not None:
            self.metrics.record_queues(self.scheduler)

    def _add(self, request_id: str, prompt: list[int], params: SamplingParams, on_output, dp_rank: int | None
             ) -> None:
        """Admits a request; one that cannot be added fails alone (its partial state removed) and the loop goes on."""
        try:
            self.scheduler.add(request_id, prompt, params, on_output, dp_rank)
        except Exception as exc:  # noqa: BLE001  (a request can fail; the engine cannot)
            self.scheduler.abort(request_id)
            self._count_failure("add", request_id, exc)
            for index in range(params.n):
                _deliver(on_output, RequestOutput(request_id, len(prompt), index=index, finished=True,
                                                  finish_reason=FINISH_ABORT, error=failure_text("add", exc)))

    def _count_failure(self, stage: str, request_id: str, exc: Exception) -> None:
        print(f"dsrun: request {request_id} failed at {stage}: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
        if self.metrics is not None:
            self.metrics.request_failures.labels(self.metrics.model_name, stage).inc()

    def step(self) -> list[tuple]:
        """One step -> (request, output) pairs to deliver; [] when there was nothing to run."""
        step = self.scheduler.schedule()
        if step is None:
            return []
        if self.shapes is not None:
            self.shapes.observe(step)
        results, reports = self._run(step.batches)
        outputs = self.scheduler.reported(reports)  # before update: what failed to arrive is no hit for anyone
        outputs += self.scheduler.update(step, results)
        for stage, request_id, exc in self.scheduler.take_failures():
            self._count_failure(stage, request_id, exc)
        if self.metrics is not None:
            self.metrics.record_step(self.scheduler, step, outputs)
            self.metrics.record_connector(self.scheduler.connector, reports)
            self.metrics.record_eplb(self.worker.balancer)
        return outputs

    def _run(self, batches: list[Batch]) -> tuple[list[list[SeqResult]], list]:
        """-> (per DP index, one result per sequence of its batch; every rank's KV connector reports, in rank
        order)."""
        if self.world_size == 1:
            return [self.worker.execute(batches[0])], self._reports()
        self._send(Plan(batches))
        everyone = self._gather(self.worker.execute(batches[self.worker.dp_index], batches))
        return ([everyone[dp_index * self.attn_tp][0] for dp_index in range(len(batches))],  # each index's reporter
                [report for _, reports in everyone for report in reports])

    def _reports(self) -> list:
        return self.worker.take_reports()

    def _send(self, plan: Plan) -> None:
        if self.world_size > 1:
            broadcast_bytes(pickle.dumps(plan), self._host, 0, PLAN_BYTES)

    def _gather(self, mine: list[SeqResult] | None) -> list[tuple] | None:
        """Every rank's (results, KV connector reports) of the step, in rank order, on rank 0 (None on the others)."""
        parts = gather_bytes(pickle.dumps((mine, self._reports())), self._host, 0, RESULT_BYTES)
        return None if parts is None else [pickle.loads(part) for part in parts]

    def _follow(self) -> None:
        while True:
            plan: Plan = pickle.loads(broadcast_bytes(None, self._host, 0, PLAN_BYTES))
            if plan.stop:
                self.worker.finish(None if plan.last is None else plan.last.get(self.worker.dp_index))
                return
            if plan.batches is None:  # keep-alive
                continue
            self._gather(self.worker.execute(plan.batches[self.worker.dp_index], plan.batches))


def _deliver(on_output, out: RequestOutput) -> None:
    try:
        on_output(out)
    except Exception as exc:  # noqa: BLE001  (one client's broken callback must not stop the engine)
        print(f"dsrun: dropping an output of request {out.request_id}: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
