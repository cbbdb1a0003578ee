"""What BF16 serving costs on this CPU against float32 (the baseline, measured in the same run): a world-1 `dsrun
serve` per dtype on the tiny random-weight model of each family with DeepSeek's real vocabulary (as the suite's BF16
server tests serve it), each given the same greedy completions.

    python scripts/bench_dtype.py [--families deepseek_v32 deepseek_v4] [--new-tokens 64] [--rounds 3]

Prints the machine (CPU flags: avx512_bf16 and AMX are BF16 in hardware; without them torch converts BF16 to float32
around every op), then per family and dtype the best round's decode tokens/s and the BF16 / float32 time ratio
(above 1: BF16 is slower here). The AVX2 stand-in of docs/testing.md applies when its variables are set for this
script: the servers inherit them.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx

from dsconv.family.layout import Layout
from dsconv.scripts.bench_serve import machine, model_id, print_machine, serving, shards_for

DTYPES = ("float32", "bfloat16")  # the baseline first
PROMPT = "介绍下北京故宫"


def timed_completion(url: str, model: str, new_tokens: int) -> float:
    """Seconds for one greedy completion of exactly `new_tokens` tokens."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": new_tokens, "ignore_eos": True, "temperature": 0}
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    elapsed = time.perf_counter() - start
    if response.status_code != 200 or response.json()["usage"]["completion_tokens"] != new_tokens:
        raise SystemExit(f"bench_dtype: the completion failed ({response.status_code}): {response.text[:300]}")
    return elapsed


def best_seconds(shards: Path, log: Path, dtype: str, new_tokens: int, rounds: int) -> float:
    """The best of `rounds` timed completions on a server of `dtype` (one short completion first, untimed)."""
    with serving(shards, log, "--dtype", dtype) as url:
        model = model_id(url)
        timed_completion(url, model, 2)
        return min(timed_completion(url, model, new_tokens) for _ in range(rounds))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["deepseek_v32", "deepseek_v4"],
                        choices=["deepseek_v3", "deepseek_v32", "deepseek_v4"])
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per timed completion (default 64)")
    parser.add_argument("--rounds", type=int, default=3, help="timed completions per server; the best counts")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dsrun-bench-dtype"))
    args = parser.parse_args()
    if args.new_tokens < 2 or args.rounds < 1:
        parser.error("--new-tokens must be at least 2 and --rounds at least 1")
    args.work.mkdir(parents=True, exist_ok=True)
    print_machine(machine(1), 1)
    for family in args.families:
        shards = shards_for(args.work, family, Layout(1, 1, 1, 1), real_vocab=True)
        seconds = {dtype: best_seconds(shards, args.work / f"{family}-{dtype}.log", dtype, args.new_tokens,
                                       args.rounds) for dtype in DTYPES}
        for dtype in DTYPES:
            print(f"{family} {dtype}: {args.new_tokens} tokens in {seconds[dtype]:.2f} s "
                  f"({args.new_tokens / seconds[dtype]:.1f} tok/s)")
        print(f"{family}: bfloat16 / float32 time {seconds['bfloat16'] / seconds['float32']:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
