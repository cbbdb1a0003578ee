"""Benchmark `dsrun serve` as `vllm bench serve` does: a fixed-seed workload of streamed completions, measured
per request by the client, against a baseline measured in the same run.

    python scripts/bench_serve.py [--url URL | --shards DIR] [--num-prompts 32] [--max-concurrency 8]
                                  [--request-rate inf] [--rounds 3] [--dtype bfloat16] [--json OUT]
    python scripts/bench_serve.py --dp-compare [--shards DIR16]

(1) Continuous vs static batching, on the same requests: every request has a random prompt of token ids and a
    random output length (uniform in --input-len / --output-len; ignore_eos, temperature 0, streamed with usage).
    Continuous: requests arrive as a Poisson process at --request-rate (inf: all at once), at most
    --max-concurrency in flight, and the server batches them as they come. Static (the baseline): the client
    sends batches of --max-concurrency requests that start together, and the next batch starts when the batch's
    longest request has ended. Per request: TTFT, TPOT ((e2e - TTFT) / (output tokens - 1)), ITL (the gaps
    between streamed chunks) and e2e; per run: request and output-token throughput. The two alternate for
    --rounds rounds; each side's best round (by request throughput) is printed, then every round's ratio
    (target: continuous >= 1.5x static at world 1, 32 requests, concurrency 8).
(2) --dp-compare: a 16-rank server (DP16 x EP16, lm_head TP16) started once with --dp-balancing least-loaded and
    once with round-robin, each given the same mixed-length requests; the mean per-step DP imbalance (max over
    mean of the tokens each DP rank feeds in a busy step, from `dsrun:dp_imbalance` on /metrics) of each.

Without --url or --shards, the script builds a tiny checkpoint of --family and its shards under --work.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import torch

from dsconv.convert.quantize import build_plan, run_quantize
from dsconv.convert.tiny_checkpoint import make_tiny_checkpoint
from dsconv.errors import InputError
from dsconv.kernels.device import cpu_model_and_flags
from dsconv.runner.models.weights import load_manifest
from dsconv.family.layout import Layout
from dsconv.shard.shard import make_shard_plan, run_shard

CONTINUOUS_TARGET = 1.5
TOKEN_IDS = (2, 1000)  # prompt token ids are drawn from here: inside the tiny fixtures' 1024-token vocabulary
SERVER_START_S = 600  # a 16-rank server loads 16 shard sets on this machine's few cores
REQUEST_TIMEOUT_S = 600
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx")


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    output_len: int


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks, seconds
    output_tokens: int = 0


def workload(n: int, input_len: tuple[int, int], output_len: tuple[int, int], rate: float, seed: int
             ) -> tuple[list[BenchRequest], list[float]]:
    """n requests with uniform random prompt and output lengths, and their arrival times (seconds from the start
    of the run): a Poisson process at `rate` requests/s, or all at 0 for rate inf."""
    rng = random.Random(seed)
    requests = [BenchRequest([rng.randrange(*TOKEN_IDS) for _ in range(rng.randint(*input_len))],
                             rng.randint(*output_len)) for _ in range(n)]
    arrivals, now = [], 0.0
    for _ in requests:
        arrivals.append(now)
        now += 0.0 if math.isinf(rate) else rng.expovariate(rate)
    return requests, arrivals


# -- the client --------------------------------------------------------------------------------------------------

async def send(client: httpx.AsyncClient, model: str, request: BenchRequest) -> Result:
    payload = {"model": model, "prompt": request.prompt, "max_tokens": request.output_len, "temperature": 0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result, started = Result(), time.perf_counter()
    last = started
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"]:
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - started
                    else:
                        result.itl.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - started
    if result.output_tokens != request.output_len:
        result.error = f"{result.output_tokens} output tokens, asked for {request.output_len} (ignore_eos)"
    else:
        result.ok = True
    return result


async def run_continuous(client, model, requests, arrivals, concurrency) -> tuple[list[Result], float]:
    gate = asyncio.Semaphore(concurrency)
    started = time.perf_counter()

    async def one(request, at):
        await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
        async with gate:
            return await send(client, model, request)

    results = await asyncio.gather(*(one(r, a) for r, a in zip(requests, arrivals)))
    return list(results), time.perf_counter() - started


async def run_static(client, model, requests, arrivals, concurrency) -> tuple[list[Result], float]:
    """Batches of `concurrency` requests in arrival order; a batch starts when its last request has arrived and
    the batch before it has ended."""
    results, started = [], time.perf_counter()
    for first in range(0, len(requests), concurrency):
        batch = requests[first:first + concurrency]
        ready = arrivals[first + len(batch) - 1]
        await asyncio.sleep(max(0.0, started + ready - time.perf_counter()))
        results += await asyncio.gather(*(send(client, model, r) for r in batch))
    return results, time.perf_counter() - started


def step_bound(requests: list[BenchRequest], concurrency: int) -> dict:
    """The most continuous batching can gain on these requests, from their output lengths alone: the steps each
    mode takes if every step costs the same, whatever it holds, and prompts cost nothing. Static: each batch
    takes as many steps as its longest output. Continuous: `concurrency` slots, each request taking the next free
    slot in arrival order for as many steps as its output; the run ends with its last request. Any engine whose
    steps cost more with more sequences in them, or whose prompts take time, gets less than this ratio."""
    outputs = [r.output_len for r in requests]
    static = sum(max(outputs[i:i + concurrency]) for i in range(0, len(outputs), concurrency))
    slots = [0] * min(concurrency, len(outputs))
    for n in outputs:
        heapq.heapreplace(slots, slots[0] + n)  # the earliest free slot takes the next request
    return {"static_steps": static, "continuous_steps": max(slots), "ratio": static / max(slots)}


def summarize(results: list[Result], duration: float) -> dict:
    done = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    itl = [gap for r in done for gap in r.itl]
    summary = {"completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
               "request_throughput": len(done) / duration,
               "output_throughput": sum(r.output_tokens for r in done) / duration,
               "errors": sorted({r.error for r in results if not r.ok})[:5]}
    latencies = {"ttft": [r.ttft for r in done], "tpot": tpot, "itl": itl, "e2e": [r.e2e for r in done]}
    for name, values in latencies.items():
        ms = np.array(values or [math.nan]) * 1e3
        summary[f"{name}_ms"] = {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)),
                                 "p99": float(np.percentile(ms, 99))}
    return summary


def print_summary(label: str, s: dict) -> None:
    print(f"  {label}: {s['completed']} completed, {s['failed']} failed in {s['duration_s']:.2f} s; "
          f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s")
    for name in ("ttft", "tpot", "itl", "e2e"):
        m = s[f"{name}_ms"]
        print(f"    {name.upper():5s} mean {m['mean']:8.1f} ms   p50 {m['p50']:8.1f} ms   p99 {m['p99']:8.1f} ms")
    for error in s["errors"]:
        print(f"    error: {error}")


async def warm_up(client, model, requests) -> None:
    longest = max(requests, key=lambda r: len(r.prompt))
    results = await asyncio.gather(*(send(client, model, BenchRequest(longest.prompt, 4)) for _ in range(2)))
    if not all(r.ok for r in results):
        raise SystemExit(f"bench_serve: the warm-up request failed: {results[0].error or results[1].error}")


def new_client(url: str, concurrency: int) -> httpx.AsyncClient:
    connections = concurrency + 4  # the requests in flight, and the warm-up's
    return httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S,
                             limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))


# -- the server ----------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serving(shards: Path, log_path: Path, *flags: str, env: dict | None = None, cpus: set[int] | None = None):
    """`dsrun serve` on shards as a subprocess (in `env`: default this one's; on `cpus` only: default all), ready
    (/health 200) -> its URL; SIGTERM at the end."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dsconv.runner.cli", "serve", "--shards", str(shards),
                                 "--port", str(port), *flags], stdout=log, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"bench_serve: the server exited with code {proc.returncode} before it was ready; "
                                 f"its log ({log_path}) ends:\n{log_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise SystemExit(f"bench_serve: the server was not ready within {SERVER_START_S} s; log: {log_path}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def model_id(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def imbalance(url: str) -> tuple[float, float]:
    """(sum, count) of the dsrun:dp_imbalance histogram on the server's /metrics."""
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in ("dsrun:dp_imbalance_sum", "dsrun:dp_imbalance_count"):
            values[name] = float(line.rsplit(" ", 1)[1])
    if len(values) != 2:
        raise SystemExit(f"bench_serve: {url}/metrics has no dsrun:dp_imbalance histogram")
    return values["dsrun:dp_imbalance_sum"], values["dsrun:dp_imbalance_count"]


def shards_for(work: Path, family: str, layout: Layout, real_vocab: bool = False, w8a8: bool = False) -> Path:
    """The family's tiny checkpoint sharded for `layout`, built under `work` once; real_vocab: with DeepSeek's real
    vocabulary (a text prompt's ids fit); w8a8: quantized by dsconv quantize (the default recipe) first."""
    kind = "-real-vocab" if real_vocab else ""
    src = work / family / f"src{kind}"
    if not (src / "config.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        make_tiny_checkpoint(src, family, real_vocab=real_vocab)
    if w8a8:
        quantized, kind = work / family / f"src{kind}-w8a8", f"{kind}-w8a8"
        if not (quantized / "config.json").exists():
            shutil.rmtree(quantized, ignore_errors=True)
            run_quantize(build_plan(src, None, "ascend", 4 * 10**9), quantized, workers=2, on_progress=lambda n: None)
        src = quantized
    out = work / family / f"shards{kind}-w{layout.world_size}"
    if not (out / "manifest.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        run_shard(make_shard_plan(src, layout, 4 * 10**9), out, 2, lambda n: None)
    return out


# -- what the figures ran on ---------------------------------------------------------------------------------------

def machine(world: int | None) -> dict:
    model, flags = cpu_model_and_flags()
    has = {flag: any(f.startswith("amx") for f in flags) if flag == "amx" else flag in flags for flag in CPU_FLAGS}
    cores = os.cpu_count() or 1
    return {"cpu": model, "cores": cores, "flags": has, "torch": torch.__version__,
            "threads_per_rank": max(1, cores // world) if world else None}


def print_machine(info: dict, world: int | None) -> None:
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in info["flags"].items())
    threads = (f"{info['threads_per_rank']} torch threads per rank ({world} ranks)" if world
               else "a server started elsewhere")
    print(f"machine: {info['cpu']}, {info['cores']} cores ({flags}); torch {info['torch']}; {threads}")


# -- the two modes -------------------------------------------------------------------------------------------------

async def compare_batching(url: str, args, requests, arrivals) -> dict:
    model = model_id(url)
    async with new_client(url, args.max_concurrency) as client:
        await warm_up(client, model, requests)
        rounds = {"static": [], "continuous": []}
        for k in range(args.rounds):
            for name, run in (("static", run_static), ("continuous", run_continuous)):
                rounds[name].append(summarize(*await run(client, model, requests, arrivals, args.max_concurrency)))
            static, continuous = rounds["static"][-1], rounds["continuous"][-1]
            print(f"  round {k + 1}/{args.rounds}: static {static['request_throughput']:.2f} req/s, continuous "
                  f"{continuous['request_throughput']:.2f} req/s", flush=True)
    return rounds


def report_batching(rounds: dict, args, requests: list[BenchRequest]) -> dict:
    best = {name: max(runs, key=lambda s: s["request_throughput"]) for name, runs in rounds.items()}
    ratio = best["continuous"]["request_throughput"] / best["static"]["request_throughput"]
    per_round = [c["request_throughput"] / s["request_throughput"]
                 for s, c in zip(rounds["static"], rounds["continuous"])]
    print(f"{args.num_prompts} requests, prompts {args.input_len[0]}-{args.input_len[1]} tokens, outputs "
          f"{args.output_len[0]}-{args.output_len[1]} tokens, request rate {args.request_rate}, max concurrency "
          f"{args.max_concurrency}, seed {args.seed} (best of {args.rounds} alternating rounds each):")
    print_summary("static batches (baseline)", best["static"])
    print_summary("continuous batching", best["continuous"])
    print(f"continuous / static request throughput: {ratio:.2f}x (target >= {CONTINUOUS_TARGET}x); round by round: "
          f"{', '.join(f'{r:.2f}x' for r in per_round)} (median {float(np.median(per_round)):.2f}x)")
    bound = step_bound(requests, args.max_concurrency)
    print(f"bound from the output lengths (equal-cost steps, free prompts): {bound['static_steps']} static steps / "
          f"{bound['continuous_steps']} continuous steps = {bound['ratio']:.2f}x; measured / bound "
          f"{ratio / bound['ratio']:.2f}")
    return {"static": best["static"], "continuous": best["continuous"], "ratio": ratio, "round_ratios": per_round,
            "bound": bound}


async def dp_run(url: str, args, requests, arrivals) -> dict:
    model = model_id(url)
    async with new_client(url, args.max_concurrency) as client:
        await warm_up(client, model, requests)
        before = imbalance(url)
        summary = summarize(*await run_continuous(client, model, requests, arrivals, args.max_concurrency))
        after = imbalance(url)
    steps = after[1] - before[1]
    summary["busy_steps"] = steps
    summary["dp_imbalance_mean"] = (after[0] - before[0]) / steps if steps else math.nan
    return summary


def main() -> int:
    try:
        return bench()
    except InputError as exc:
        raise SystemExit(f"bench_serve: {exc}") from None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (its model is the first of /v1/models)")
    parser.add_argument("--shards", type=Path, help="shards to serve (default: a tiny checkpoint built in --work)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dsrun-bench-serve"))
    parser.add_argument("--family", default="deepseek_v32", choices=["deepseek_v3", "deepseek_v32", "deepseek_v4"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-prompts", type=int, default=None, help="default 32, or 64 with --dp-compare")
    parser.add_argument("--input-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[8, 128], metavar=("MIN", "MAX"))
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="default 8, or 64 with --dp-compare")
    parser.add_argument("--rounds", type=int, default=3, help="alternating static/continuous rounds; best counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dp-compare", action="store_true", help="least-loaded vs round-robin DP balancing, 16 ranks")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    args.num_prompts = args.num_prompts or (64 if args.dp_compare else 32)
    args.max_concurrency = args.max_concurrency or (64 if args.dp_compare else 8)
    for name in ("input_len", "output_len"):
        low, high = getattr(args, name)
        if not 1 <= low <= high:
            parser.error(f"--{name.replace('_', '-')} {low} {high}: need 1 <= MIN <= MAX")
    if args.num_prompts < 1 or args.max_concurrency < 1 or args.rounds < 1 or args.request_rate <= 0:
        parser.error("--num-prompts, --max-concurrency, --rounds and --request-rate must be positive")
    if args.url and args.dp_compare:
        parser.error("--dp-compare starts its own servers (one per balancing); it takes --shards, not --url")
    return args


def dp_compare(args, requests, arrivals, flags: list[str], figures: dict) -> None:
    """(2): a 16-rank server per --dp-balancing, each given the same requests; their figures go into `figures`."""
    shards = args.shards or shards_for(args.work, args.family, Layout(16, 16, 16, 1))
    world = load_manifest(shards)["layout"]["world_size"]
    figures["machine"] = machine(world)
    print_machine(figures["machine"], world)
    print(f"{shards} ({world} ranks, {args.dtype}): {args.num_prompts} requests, prompts {args.input_len[0]}-"
          f"{args.input_len[1]} tokens, outputs {args.output_len[0]}-{args.output_len[1]} tokens, request rate "
          f"{args.request_rate}, max concurrency {args.max_concurrency}, seed {args.seed}", flush=True)
    for balancing in ("least-loaded", "round-robin"):
        with serving(shards, args.work / f"serve-{balancing}.log", *flags, "--dp-balancing", balancing) as url:
            summary = asyncio.run(dp_run(url, args, requests, arrivals))
        figures[balancing] = summary
        print(f"  --dp-balancing {balancing}: mean DP imbalance {summary['dp_imbalance_mean']:.3f} over "
              f"{summary['busy_steps']:.0f} busy steps; {summary['completed']} completed, {summary['failed']} "
              f"failed, {summary['request_throughput']:.2f} req/s, {summary['output_throughput']:.1f} output "
              f"tok/s", flush=True)
    ratio = figures["round-robin"]["dp_imbalance_mean"] / figures["least-loaded"]["dp_imbalance_mean"]
    figures["imbalance_ratio"] = ratio
    print(f"round-robin / least-loaded mean DP imbalance: {ratio:.2f}x (least-loaded should be lower)")


def bench() -> int:
    args = parse_args()
    requests, arrivals = workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len),
                                  args.request_rate, args.seed)
    args.work.mkdir(parents=True, exist_ok=True)
    flags = ["--dtype", args.dtype, "--max-num-seqs", str(max(16, args.max_concurrency))]
    figures = {"workload": {k: (str(v) if isinstance(v, (Path, float)) else v) for k, v in vars(args).items()}}

    if args.dp_compare:
        dp_compare(args, requests, arrivals, flags, figures)
    elif args.url:
        figures["machine"] = machine(None)
        print_machine(figures["machine"], None)
        rounds = asyncio.run(compare_batching(args.url, args, requests, arrivals))
        figures.update(report_batching(rounds, args, requests))
    else:
        shards = args.shards or shards_for(args.work, args.family, Layout(1, 1, 1, 1))
        world = load_manifest(shards)["layout"]["world_size"]
        figures["machine"] = machine(world)
        print_machine(figures["machine"], world)
        print(f"serving {shards} ({world} ranks, {args.dtype})", flush=True)
        with serving(shards, args.work / "serve.log", *flags) as url:
            rounds = asyncio.run(compare_batching(url, args, requests, arrivals))
        figures.update(report_batching(rounds, args, requests))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=str))
    failed = sum(figures[k]["failed"] for k in ("static", "continuous", "least-loaded", "round-robin") if k in figures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
