"""Prefill/decode disaggregation against colocated serving on the same total ranks, in one run.

    python scripts/bench_pd.py [--family deepseek_v32] [--ranks 2] [--long-tokens 1536] [--work DIR] [--json FILE]

Workload (token ids, the tiny checkpoint's vocabulary, random weights, greedy, ignore_eos): DECODERS requests with
short prompts decode DECODE_TOKENS tokens each, streamed, while LONG_PROMPTS long prompts (--long-tokens) arrive one
every LONG_EVERY_S seconds, each asking for a few tokens. Reported for each setup: the long prompts' TTFT and the
decoders' inter-token latency (ITL), p50 and p99, and their ratios, disaggregated over colocated.
- colocated: one `dsrun serve` at world --ranks (attention DP over every rank);
- disaggregated: a producer at world --ranks / 2 and a consumer at world --ranks / 2 behind `dsrun router`.

The hand-over's bytes per token are measured (the consumer's kv_transfer_bytes over its received tokens) and checked
against the family's cache formula at the tiny dimensions, then that formula gives the real model's: with it, the
transfer of an 8K-token prompt at the real dimensions, on paper, at a stated link rate (an assumption, printed).

Cores: the colocated instance runs on every core; the producer on one half of them and the consumer on the other
(their thread pools sized to their half), as instances on nodes of their own would. The router and this client run
anywhere.

What 2 cores can show: the stall a long prefill puts on the decodes that share its ranks (colocated), against
decodes that never share a step with a prefill (disaggregated), at equal rank and core counts. What they cannot: a
node's worth of cores per instance (here one core each, so P's prefill is as slow as one rank makes it), the router,
the client and the transfer engines' threads taking cores from both, and a real network: the transfer runs over
loopback TCP, not RoCE / HCCS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import torch

from dsconv.family.arch import family_for
from dsconv.family.layout import Layout
from dsconv.kernels.linear import matmul_dtype_for
from dsconv.scripts.bench_serve import machine, print_machine, serving, shards_for
from dsconv.shard.sizes import kv_cache_bytes_per_token

DECODERS, DECODE_TOKENS, DECODER_PROMPT = 4, 96, 24
LONG_PROMPTS, LONG_TOKENS_OUT, LONG_EVERY_S = 6, 4, 1.5
SERVER_FLAGS = ("--dtype", "bfloat16", "--cache-tokens", "16384", "--served-model-name", "bench")
PD_KEY = secrets.token_hex(16)  # a fresh secret per run, which P signs its hand-overs with (docs/pd.md: trust)
PRODUCER, CONSUMER = (json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role,
                                  "kv_connector_extra_config": {"auth_key": PD_KEY}})
                      for role in ("kv_producer", "kv_consumer"))
# the runner's cache on CPU: BF16 entries are kept as float32, the dtype its matmuls run in (kernels/linear.py)
CPU_CACHE = matmul_dtype_for(torch.bfloat16, "cpu")
PAPER_PROMPT = 8192  # tokens of the prompt whose transfer is worked out at the real dimensions
LINK_GBPS = (25.0, 50.0)  # GB/s per card assumed for the paper figures: RoCE 200G and 400G line rates
DATA = Path(__file__).resolve().parent.parent / "tests" / "data"  # the hub's config.json of each family (a data file)
REAL_CONFIGS = {"deepseek_v32": DATA / "deepseek_v32_exp.config.json",
                "deepseek_v4": DATA / "deepseek_v4_flash.config.json"}


async def stream(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """One streamed greedy completion -> (TTFT, the gaps between its tokens)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    started = last = time.perf_counter()
    ttft, gaps = 0.0, []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"bench_pd: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if ttft == 0.0:
                ttft = now - started
            else:
                gaps.append(now - last)
            last = now
    return ttft, gaps


async def workload(url: str, long_tokens: int, seed: int) -> dict:
    """The decoders and the long prompts against one endpoint -> their TTFT and ITL figures."""
    prompt = lambda n, k: [(seed * 7919 + k * 104729 + i * 31) % 1000 + 2 for i in range(n)]  # noqa: E731
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await stream(client, prompt(DECODER_PROMPT, -1), 2)  # warm-up

        async def long(k: int):
            await asyncio.sleep(0.5 + k * LONG_EVERY_S)
            return await stream(client, prompt(long_tokens, k), LONG_TOKENS_OUT)

        decoders = [stream(client, prompt(DECODER_PROMPT, 100 + k), DECODE_TOKENS) for k in range(DECODERS)]
        results = await asyncio.gather(*decoders, *(long(k) for k in range(LONG_PROMPTS)))
    itl = sorted(gap for _, gaps in results[:DECODERS] for gap in gaps)
    ttft = sorted(first for first, _ in results[DECODERS:])
    return {"itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
            "long_ttft_p50_s": percentile(ttft, 50), "long_ttft_p99_s": percentile(ttft, 99)}


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


@contextmanager
def routed(log: Path, prefill: str, decode: str):
    """`dsrun router` in front of one producer and one consumer -> its URL."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dsconv.runner.cli", "router", "--port", "0", "--prefill",
                                 prefill, "--decode", decode], stdout=out, stderr=subprocess.STDOUT)
    try:
        while not (bound := re.search(r"on (http://\S+),", log.read_text())):
            if proc.poll() is not None:
                raise SystemExit(f"bench_pd: the router exited: {log.read_text()[-1000:]}")
            time.sleep(0.2)
        yield bound.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def bytes_per_token(family: str, config: dict, dtype: str, itemsize: int | None = None) -> float:
    """The family's cache formula: bytes per token over every decoder layer, in BF16 or `itemsize`-byte entries (or
    INT8 with scales)."""
    fam = family_for(config)
    if fam.name != family:
        raise SystemExit(f"bench_pd: {family}'s config reads as {fam.name}")
    arch = fam.parse_config(config)
    if itemsize is None:
        return sum(kv_cache_bytes_per_token(fam, arch, dtype).values())
    return sum(fam.kv_cache_bytes_per_token(arch, itemsize, dtype).values())


def run(args) -> dict:
    half = args.ranks // 2
    small, whole = (shards_for(args.work, args.family, Layout(w, w, w, 1)) for w in (half, args.ranks))
    figures: dict = {"machine": machine(args.ranks), "family": args.family, "ranks": args.ranks,
                     "long_tokens": args.long_tokens}
    logs = Path(tempfile.mkdtemp(prefix="bench_pd-"))
    with serving(whole, logs / "colocated.log", *SERVER_FLAGS) as url:
        figures["colocated"] = asyncio.run(workload(url, args.long_tokens, seed=1))
    cores = sorted(os.sched_getaffinity(0))  # P on one half of the cores, D on the other, as on nodes of their own
    p_cores, d_cores = (set(cores[:len(cores) // 2]), set(cores[len(cores) // 2:])) if len(cores) > 1 else (None, None)
    figures["cores"] = {"colocated": cores, "producer": sorted(p_cores or cores), "consumer": sorted(d_cores or cores)}
    with ExitStack() as stack:
        p = stack.enter_context(serving(small, logs / "p.log", *SERVER_FLAGS, "--kv-transfer-config", PRODUCER,
                                        cpus=p_cores))
        d = stack.enter_context(serving(small, logs / "d.log", *SERVER_FLAGS, "--kv-transfer-config", CONSUMER,
                                        cpus=d_cores))
        figures["disaggregated"] = asyncio.run(workload(stack.enter_context(routed(logs / "router.log", p, d)),
                                                        args.long_tokens, seed=1))
        received = metric(d, "dsrun:kv_transfer_received_tokens_total")
        figures["transfer"] = {"bytes": metric(d, "dsrun:kv_transfer_bytes_total"), "tokens": received,
                               "seconds": metric(d, "dsrun:kv_transfer_seconds_sum"),
                               "reads": metric(d, "dsrun:kv_transfer_seconds_count")}
    figures["ratios"] = {key: figures["disaggregated"][key] / figures["colocated"][key]
                         for key in figures["colocated"]}
    tiny = json.loads((small / "config.json").read_text())
    real = json.loads(REAL_CONFIGS[args.family].read_text())
    figures["bytes_per_token"] = {"measured": figures["transfer"]["bytes"] / max(1.0, received),
                                  "formula_tiny": bytes_per_token(args.family, tiny, "auto", CPU_CACHE.itemsize),
                                  "formula_real_bf16": bytes_per_token(args.family, real, "auto"),
                                  "formula_real_int8": bytes_per_token(args.family, real, "int8")}
    return figures


def report(figures: dict) -> None:
    print_machine(figures["machine"], figures["ranks"])
    print(f"cores: colocated {figures['cores']['colocated']}, producer {figures['cores']['producer']}, consumer "
          f"{figures['cores']['consumer']}")
    print(f"{figures['family']}, {figures['ranks']} ranks in all; {DECODERS} decoders x {DECODE_TOKENS} tokens while "
          f"{LONG_PROMPTS} prompts of {figures['long_tokens']} tokens arrive every {LONG_EVERY_S} s")
    for key in figures["colocated"]:
        c, d = figures["colocated"][key], figures["disaggregated"][key]
        print(f"  {key:16} colocated {c:9.3f}   disaggregated {d:9.3f}   ratio {d / c:6.2f}")
    t, b = figures["transfer"], figures["bytes_per_token"]
    print(f"  transfer: {t['tokens']:.0f} tokens, {t['bytes']:.0f} bytes in {t['reads']:.0f} reads, "
          f"{1e3 * t['seconds'] / max(1.0, t['reads']):.2f} ms per read")
    print(f"  bytes per token: measured {b['measured']:.1f}, the cache formula at the tiny dimensions "
          f"{b['formula_tiny']:.1f} (in {CPU_CACHE}, the CPU cache's dtype)")
    for dtype in ("bf16", "int8"):
        per_token = b[f"formula_real_{dtype}"]
        total = per_token * PAPER_PROMPT
        rates = ", ".join(f"{1e3 * total / (gbps * 1e9):.1f} ms at {gbps:g} GB/s" for gbps in LINK_GBPS)
        print(f"  on paper, the real {figures['family']} ({dtype} cache): {per_token / 1024:.1f} KiB per token, "
              f"{total / 2**20:.0f} MiB per {PAPER_PROMPT}-token prompt: {rates} (assumed link rates)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="deepseek_v32", choices=["deepseek_v32", "deepseek_v4"])
    parser.add_argument("--ranks", type=int, default=2, help="ranks in all: colocated at this world, P and D at half")
    parser.add_argument("--long-tokens", type=int, default=1536, help="tokens of each long prompt")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench_pd")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.ranks < 2 or args.ranks % 2:
        parser.error("--ranks must be even and at least 2")
    figures = run(args)
    report(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
