"""Prefix caching against a live `dsrun serve`, on and off in one run, on two workloads that resend prefixes.

    python scripts/bench_prefix.py [--families deepseek_v32 deepseek_v4] [--worlds 1 16] [--concurrency 8]
                                   [--work DIR] [--json FILE] [--offload]

Workloads (token ids, the tiny checkpoints' real vocabulary, random weights, temperature 0):
- chat: 16 conversations x 4 turns behind one 512-token system prompt. Each turn's prompt is the conversation so far:
  every earlier question (24 tokens) and the server's answer to it (16 tokens, the ids it streamed), then a new
  question. The conversations run side by side (--concurrency at a time), each turn after the one before.
- agent: 32 requests of one 1,024-token tool-definition prefix and a 32-token tail of their own, 16 tokens out.

For each family and world size, a server is started with prefix caching on, then one with
--no-enable-prefix-caching, on the same shards, and both workloads run against each. Reported per run:
- prompt tokens sent and computed (sent less the cached ones the final usage chunk reports);
- hit rate: cached / sent;
- TTFT p50 / p90, from the request to its first streamed token;
- request and output-token throughput.
At world 16, the chat workload also runs with prefix caching on under --dp-balancing least-loaded and round-robin,
against the default cache-aware placement: the hit rate each placement gets (a hit needs the request on the DP
rank that holds its conversation's blocks).

Both families take hits at every block boundary (DeepSeek-V4 restores its sliding window and compressor state
from the state blocks published with the blocks).

--offload runs the KV offload workload instead (runner/engine/kv_offload.py): 16 conversations x 4 turns, each with
a 512-token context of its own, 2 at a time, so that between two turns of one conversation the other fifteen pass.
Their working set (every conversation's last prompt, OFFLOAD_TOKENS) is OFFLOAD_FACTOR times the device pool each
server gets (--cache-tokens). One server runs with --kv-offloading-size (OFFLOAD_HOST_GIB), one without, both with
prefix caching: the prompt tokens each computes, their ratio (the target: at most 0.35), and each server's peak
resident memory (its processes' VmRSS summed, sampled every RSS_EVERY_S): the offloading one's growth over the other's
is what its host tier holds, bounded by its size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from dsconv.family.layout import Layout
from dsconv.scripts.bench_serve import (TOKEN_IDS, machine, model_id, new_client, print_machine, serving,
                                        shards_for)

SYSTEM_TOKENS, QUESTION_TOKENS, ANSWER_TOKENS = 512, 24, 16
CONVERSATIONS, TURNS = 16, 4
TOOLS_TOKENS, TAIL_TOKENS, AGENT_REQUESTS = 1024, 32, 32
SERVER_FLAGS = ("--dtype", "bfloat16", "--cache-tokens", "32768", "--max-num-seqs", "16")
CONTEXT_TOKENS, OFFLOAD_CONCURRENCY = 512, 2  # the offload workload's per-conversation context; conversations at once
OFFLOAD_TOKENS = CONVERSATIONS * (CONTEXT_TOKENS + TURNS * (QUESTION_TOKENS + ANSWER_TOKENS))  # its working set
OFFLOAD_FACTOR = 4  # working set over the device pool
OFFLOAD_HOST_GIB = 0.25  # the host tier: holds the tiny models' whole working set (about 64 MiB for V3.2 in BF16)
RSS_EVERY_S = 0.2


@dataclass
class Sent:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    ttft: float = 0.0


async def send(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> Sent:
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}, "logprobs": 0,
               "return_tokens_as_token_ids": True}
    sent, started = Sent(), time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=payload) as response:
        if response.status_code != 200:
            raise SystemExit(f"bench_prefix: HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                sent.prompt_tokens = chunk["usage"]["prompt_tokens"]
                sent.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            for choice in chunk["choices"]:
                if not sent.ttft:
                    sent.ttft = time.perf_counter() - started
                for token in (choice.get("logprobs") or {}).get("tokens", []):
                    sent.output_ids.append(int(token.removeprefix("token_id:")))
    return sent


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_IDS) for _ in range(n)]


async def chat(client, model: str, concurrency: int, seed: int) -> list[Sent]:
    rng = random.Random(seed)
    system = ids(rng, SYSTEM_TOKENS)
    return await conversations(client, model, concurrency, [system] * CONVERSATIONS, rng)


async def conversations(client, model: str, concurrency: int, contexts: list[list[int]], rng: random.Random
                        ) -> list[Sent]:
    """One conversation per context, TURNS turns each (a new question, the server's answer), `concurrency` turns at
    a time, each conversation's turn after its one before."""
    questions = [[ids(rng, QUESTION_TOKENS) for _ in range(TURNS)] for _ in contexts]
    gate, results = asyncio.Semaphore(concurrency), []

    async def conversation(c: int) -> None:
        history = list(contexts[c])
        for turn in range(TURNS):
            history += questions[c][turn]
            async with gate:
                sent = await send(client, model, history, ANSWER_TOKENS)
            results.append(sent)
            history += sent.output_ids

    await asyncio.gather(*(conversation(c) for c in range(len(contexts))))
    return results


async def offload_chat(client, model: str, seed: int) -> list[Sent]:
    """The --offload workload: chat without a shared prefix, OFFLOAD_CONCURRENCY conversations at a time."""
    rng = random.Random(seed + 2)
    contexts = [ids(rng, CONTEXT_TOKENS) for _ in range(CONVERSATIONS)]
    return await conversations(client, model, OFFLOAD_CONCURRENCY, contexts, rng)


def server_pids(port: int) -> list[int]:
    """The `dsrun serve --port PORT` process and every process below it (its ranks)."""
    roots = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p).count(f"{port}")
             and "serve" in _cmdline(p)]
    found, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        found.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                todo += [int(child) for child in task.read_text().split()]
            except OSError:
                continue
    return found


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


async def run_offload(url: str) -> dict:
    """The --offload workload against one server, its peak RSS sampled alongside."""
    model, port = model_id(url), int(url.rsplit(":", 1)[1])
    pids, peak, done = server_pids(port), [0], asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes(pids))
            await asyncio.sleep(RSS_EVERY_S)

    async with new_client(url, OFFLOAD_CONCURRENCY) as client:
        await send(client, model, ids(random.Random(99), 64), 2)
        sampler = asyncio.create_task(sample())
        started = time.perf_counter()
        results = await offload_chat(client, model, seed=7)
        done.set()
        await sampler
    return {**summary(results, time.perf_counter() - started), "peak_rss_bytes": peak[0]}


def offload_comparison(args, family: str, world: int) -> dict:
    """--offload: the workload with and without a host tier, one server each -> the figures."""
    shards = shards_for(args.work, family, Layout(world, world, world, 1), real_vocab=True)
    pool = OFFLOAD_TOKENS // OFFLOAD_FACTOR
    flags = ("--dtype", "bfloat16", "--cache-tokens", str(pool), "--max-num-seqs", str(OFFLOAD_CONCURRENCY))
    out = {}
    for label, extra in (("offload", ("--kv-offloading-size", str(OFFLOAD_HOST_GIB))), ("device only", ())):
        with serving(shards, args.work / f"server-{family}-w{world}-{label.replace(' ', '-')}.log", *flags,
                     *extra) as url:
            out[label] = asyncio.run(run_offload(url))
        print_row(f"offload workload, {label}", out[label])
        print(f"  {'':<34} peak RSS {out[label]['peak_rss_bytes'] / 2**20:.0f} MiB", flush=True)
    ratio = out["offload"]["computed_tokens"] / out["device only"]["computed_tokens"]
    growth = out["offload"]["peak_rss_bytes"] - out["device only"]["peak_rss_bytes"]
    print(f"  working set {OFFLOAD_TOKENS} tokens, device pool {pool} ({OFFLOAD_FACTOR}x); computed with offload / "
          f"without: {ratio:.3f} (target <= 0.35); peak RSS growth {growth / 2**20:.0f} MiB against a host tier of "
          f"{OFFLOAD_HOST_GIB * 1024:.0f} MiB", flush=True)
    return {**out, "computed_ratio": ratio, "rss_growth_bytes": growth, "pool_tokens": pool,
            "working_set_tokens": OFFLOAD_TOKENS, "host_gib": OFFLOAD_HOST_GIB}


async def agent(client, model: str, concurrency: int, seed: int) -> list[Sent]:
    rng = random.Random(seed + 1)
    tools = ids(rng, TOOLS_TOKENS)
    tails = [ids(rng, TAIL_TOKENS) for _ in range(AGENT_REQUESTS)]
    gate = asyncio.Semaphore(concurrency)

    async def one(tail: list[int]) -> Sent:
        async with gate:
            return await send(client, model, tools + tail, ANSWER_TOKENS)

    return list(await asyncio.gather(*(one(tail) for tail in tails)))


def summary(results: list[Sent], seconds: float) -> dict:
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    ttfts = sorted(r.ttft for r in results)
    return {"requests": len(results), "prompt_tokens": prompt, "computed_tokens": prompt - cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
            "requests_per_s": len(results) / seconds,
            "output_tokens_per_s": sum(len(r.output_ids) for r in results) / seconds}


async def run_workloads(url: str, concurrency: int, only_chat: bool = False) -> dict:
    model = model_id(url)
    out = {}
    async with new_client(url, concurrency) as client:
        await send(client, model, ids(random.Random(99), 64), 2)  # warm-up, shares no prefix with the workloads
        for name, workload in (("chat", chat), ("agent", agent)):
            if only_chat and name != "chat":
                continue
            started = time.perf_counter()
            results = await workload(client, model, concurrency, seed=7)
            out[name] = summary(results, time.perf_counter() - started)
    return out


def print_row(label: str, s: dict) -> None:
    print(f"  {label:<34} sent {s['prompt_tokens']:>6}, computed {s['computed_tokens']:>6}, hit rate "
          f"{100 * s['hit_rate']:5.1f}%, TTFT p50 {1000 * s['ttft_p50_s']:7.1f} ms p90 {1000 * s['ttft_p90_s']:7.1f} ms, "
          f"{s['requests_per_s']:.2f} req/s, {s['output_tokens_per_s']:.1f} tok/s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["deepseek_v32", "deepseek_v4"])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dsconv-bench-prefix")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--offload", action="store_true", help="the KV offload workload only (module docstring)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    print_machine(machine(max(args.worlds)), max(args.worlds))
    results = {}
    if args.offload:
        for family in args.families:
            for world in args.worlds:
                print(f"{family}, world {world}:", flush=True)
                results[f"{family} w{world} offload"] = offload_comparison(args, family, world)
        if args.json:
            args.json.write_text(json.dumps({"machine": machine(max(args.worlds)), "results": results}, indent=1))
        return 0
    for family in args.families:
        for world in args.worlds:
            shards = shards_for(args.work, family, Layout(world, world, world, 1), real_vocab=True)
            runs = [("caching on (cache-aware)", ()), ("caching off", ("--no-enable-prefix-caching",))]
            if world > 1:
                runs += [("caching on, least-loaded", ("--dp-balancing", "least-loaded")),
                         ("caching on, round-robin", ("--dp-balancing", "round-robin"))]
            print(f"{family}, world {world}:", flush=True)
            for label, flags in runs:
                log = args.work / f"server-{family}-w{world}-{len(results)}.log"
                with serving(shards, log, *SERVER_FLAGS, *flags) as url:
                    got = asyncio.run(run_workloads(url, args.concurrency, only_chat="balancing" in " ".join(flags)
                                                    or "--dp-balancing" in flags))
                for workload, s in got.items():
                    print_row(f"{workload}, {label}", s)
                    results[f"{family} w{world} {workload} {label}"] = s
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(max(args.worlds)), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
