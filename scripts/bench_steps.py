"""What one engine step costs by how many sequences it holds, and the engine alone (no HTTP) on bench_serve's
workload as continuous and as static batches.

    python scripts/bench_steps.py [--family deepseek_v32|deepseek_v3|deepseek_v4] [--dtype bfloat16] [--rounds 3]
                                  [--work DIR]

(1) Decode steps: for 1, 2, 4, 8 and 16 sequences (random prompts of 16-256 tokens, prefilled first), the median
    and the fastest of 40 decode steps through the scheduler, worker and model, in process at world size 1. How
    a step's cost grows with its sequences decides what continuous batching can gain over static batches, whose
    tail holds few sequences.
(2) Prefill: one step with one prompt of 136 tokens, and one with eight.
(3) bench_serve's default workload (32 requests, prompts 16-256, outputs 8-128, seed 0) through the engine in
    process: static batches of 8 (a batch starts when the previous one has ended), and continuous (8 running,
    a request joins when one ends), alternating for --rounds rounds; every round's times, the ratio of each
    side's fastest round, and the bound `bench_serve.step_bound` gives from the output lengths. The gap between
    this ratio and bench_serve's is what the HTTP front end and the client, on the same cores, take.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

from dsconv.runner.models.dist import Dist
from dsconv.runner.models.registry import DTYPES, build_model
from dsconv.runner.engine.config import EngineConfig, SchedulerConfig
from dsconv.runner.engine.core import new_engine
from dsconv.runner.engine.request import SamplingParams
from dsconv.runner.models.weights import load_manifest
from dsconv.scripts.bench_serve import (TOKEN_IDS, machine, print_machine, shards_for, step_bound,
                                        workload)
from dsconv.family.layout import Layout

SEQUENCES = (1, 2, 4, 8, 16)
DECODE_STEPS = 40
CACHE_TOKENS = 16384
CONCURRENCY = 8


class Engine:
    """A fresh scheduler and cache around the loaded model, as `dsrun serve` runs them on one rank."""

    def __init__(self, model, new_cache):
        cache = new_cache(CACHE_TOKENS)
        self.core = new_engine(model, cache, Dist(), EngineConfig(
            vocab_size=model.cfg.vocab_size, max_model_len=CACHE_TOKENS,
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4096)))
        self.scheduler = self.core.scheduler
        self.added = 0

    def add(self, prompt: list[int], max_tokens: int) -> None:
        self.scheduler.add(str(self.added), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None)
        self.added += 1

    def timed_step(self) -> tuple[float, list]:
        started = time.perf_counter()
        outputs = self.core.step()
        return time.perf_counter() - started, outputs


def decode_costs(model, new_cache, rng: random.Random) -> None:
    print(f"decode step by sequences (median / fastest of {DECODE_STEPS} steps):")
    for n in SEQUENCES:
        engine = Engine(model, new_cache)
        for _ in range(n):
            engine.add([rng.randrange(*TOKEN_IDS) for _ in range(rng.randint(16, 256))], DECODE_STEPS + 2)
        engine.timed_step()  # the prefill
        times = [engine.timed_step()[0] for _ in range(DECODE_STEPS)]
        print(f"  {n:2d} sequences: {1e3 * statistics.median(times):6.2f} / {1e3 * min(times):6.2f} ms", flush=True)


def prefill_costs(model, new_cache, rng: random.Random) -> None:
    for n in (1, 8):
        times = []
        for _ in range(3):
            engine = Engine(model, new_cache)
            for _ in range(n):
                engine.add([rng.randrange(*TOKEN_IDS) for _ in range(136)], 1)
            times.append(engine.timed_step()[0])
        print(f"prefill, {n} prompt(s) of 136 tokens in one step: {1e3 * min(times):.1f} ms (fastest of 3)", flush=True)


def run_static(model, new_cache, requests) -> float:
    engine, started = Engine(model, new_cache), time.perf_counter()
    for first in range(0, len(requests), CONCURRENCY):
        for request in requests[first:first + CONCURRENCY]:
            engine.add(request.prompt, request.output_len)
        while engine.scheduler.has_work:
            engine.core.step()
    return time.perf_counter() - started


def run_continuous(model, new_cache, requests) -> float:
    engine, started = Engine(model, new_cache), time.perf_counter()
    waiting = list(requests)
    for request in waiting[:CONCURRENCY]:
        engine.add(request.prompt, request.output_len)
    waiting = waiting[CONCURRENCY:]
    while engine.scheduler.has_work:
        for _, out in engine.core.step():
            if out.finished and waiting:
                request = waiting.pop(0)
                engine.add(request.prompt, request.output_len)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="deepseek_v32", choices=["deepseek_v3", "deepseek_v32", "deepseek_v4"])
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/dsrun-bench-serve"))
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be positive")
    shards = shards_for(args.work, args.family, Layout(1, 1, 1, 1))
    info = machine(1)
    print_machine(info, 1)
    print(f"{shards} ({args.family}, {args.dtype}), in process, world size 1", flush=True)
    model, _, new_cache = build_model(shards, load_manifest(shards), 0, Dist(), DTYPES[args.dtype])
    rng = random.Random(0)
    decode_costs(model, new_cache, rng)
    prefill_costs(model, new_cache, rng)
    requests, _ = workload(32, (16, 256), (8, 128), math.inf, 0)
    run_static(model, new_cache, requests[:CONCURRENCY])  # warm-up
    times: dict[str, list[float]] = {"static": [], "continuous": []}
    for k in range(args.rounds):
        times["static"].append(run_static(model, new_cache, requests))
        times["continuous"].append(run_continuous(model, new_cache, requests))
        print(f"  round {k + 1}/{args.rounds}: static {times['static'][-1]:.2f} s, continuous "
              f"{times['continuous'][-1]:.2f} s", flush=True)
    bound = step_bound(requests, CONCURRENCY)
    print(f"engine alone, continuous / static throughput (each side's fastest round, as bench_serve counts): "
          f"{min(times['static']) / min(times['continuous']):.2f}x; bound from the output lengths "
          f"{bound['ratio']:.2f}x ({bound['static_steps']} / {bound['continuous_steps']} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
