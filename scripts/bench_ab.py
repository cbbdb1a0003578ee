"""Paired A/B of two revisions of dsrun on one machine in one run: this tree's code against a base revision's
(a refactoring must leave speed unchanged within noise).

    python scripts/bench_ab.py --base REV [--family deepseek_v32] [--rounds 8] [--new-tokens 64] [--work DIR]
                               [--world16-rounds N [--world16-batch 1 16] [--world16-encodings bf16 w8a8]]
                               [--skip-serve] [--batch 1 16] [--rss-prompt-len 2048]

The base revision is checked out into a temporary git worktree; each side runs in its own processes with
PYTHONPATH pointing `dsconv` at its code, on the same shards (a tiny checkpoint of --family sharded for one
rank by this tree's code; the shard format is the same on both sides).
(1) Decode tokens/s at world 1, BF16, in process: one long-lived process per side loads the model once; the
    two then take turns, one generation of --new-tokens tokens each per round, so both meet the same spells of
    machine load. Decode = generation after the first token. With --batch B (one run per B given), B prompts of
    32 tokens run at once (every prompt's first token comes from one prefill step; decode tokens/s counts the
    tokens after it, over every request).
(2) `dsrun serve` at world 1: one server per side, both up for the whole run; bench_serve.py's continuous
    workload (32 streamed completions, prompts 16-256 tokens, outputs 8-128, concurrency 8, seed 0) sent to
    each in turn, round after round.
(3) With --world16-rounds N: `dsrun generate --json` at world 16 (a real-vocabulary tiny checkpoint sharded EP16,
    lm_head TP16, attention DP16), each side's own CLI in turn, N rounds: the decode tokens/s rank 0 reports; one
    A/B per --world16-batch B (B prompts at once) and per --world16-encodings (bf16, w8a8: quantized first).
(4) With --rss-prompt-len N: the peak resident memory of a fresh process per side that loads the model, then
    serves 16 concurrent requests of N-token prompts (8 new tokens each, prefilled in chunks of 4096 tokens) from
    a cache holding exactly them: ru_maxrss after the load and at the end, and their difference.
Each side's median and best round are printed with the head/base ratio of each; a ratio within the rounds'
spread means no change.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT_LEN = 32


RSS_REQUESTS = 16
RSS_NEW_TOKENS = 8
RSS_CHUNK = 4096


def current_layout() -> tuple:
    """This layout's calls: the engine from core.new_engine, fed through its door (in core.py, or in client.py
    before). (build_model, Dist, load_manifest, BLOCK_SIZE, greedy, generate_batch); ImportError in an older one."""
    try:
        from dsconv.runner.engine.core import EngineClient
        from dsconv.runner.models.registry import build_model
    except ImportError:
        from dsconv.runner.engine.client import EngineClient
        from dsconv.runner.engine.worker import build_model
    try:
        from dsconv.family.arch import DEFAULT_BLOCK_SIZE as BLOCK_SIZE
    except ImportError:
        from dsconv.runner.models.kv_cache import BLOCK_SIZE
    from dsconv.runner.engine.config import SchedulerConfig
    from dsconv.runner.engine.core import new_engine
    from dsconv.runner.engine.request import SamplingParams
    from dsconv.runner.models.dist import Dist
    from dsconv.runner.models.weights import load_manifest

    def engine_of(model, cache, eos_id, scheduler):
        limits = {"vocab_size": model.cfg.vocab_size, "max_model_len": cache.num_blocks * cache.block_size,
                  "eos_token_id": eos_id, "scheduler": scheduler}
        try:  # the engine's settings as one typed value (engine/config.py)
            from dsconv.runner.engine.config import EngineConfig
        except ImportError:  # as keywords, before
            return new_engine(model, cache, Dist(), **limits)
        return new_engine(model, cache, Dist(), EngineConfig(**limits))

    def greedy(model, cache, prompts, max_new_tokens, eos_id, on_token):
        scheduler = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=len(prompts[0]))
        engine = engine_of(model, cache, eos_id, scheduler)
        door = EngineClient()
        door.open(engine)
        door.submit(prompts[0], SamplingParams(max_tokens=max_new_tokens),
                    lambda out: [on_token(0, token) for token in out.new_token_ids])
        engine.run(door, until_idle=True)

    def generate_batch(model, new_cache, prompts, max_new_tokens, on_token, budget) -> None:
        tokens = len(prompts) * (len(prompts[0]) + max_new_tokens)
        try:
            cache = new_cache(tokens, max_seqs=len(prompts))
        except TypeError:  # a cache without sequence slots
            cache = new_cache(tokens)
        scheduler = SchedulerConfig(max_num_seqs=len(prompts), max_num_batched_tokens=budget)
        engine = engine_of(model, cache, None, scheduler)
        door = EngineClient()
        door.open(engine)
        for i, prompt in enumerate(prompts):
            door.submit(prompt, SamplingParams(max_tokens=max_new_tokens),
                        lambda out, i=i: [on_token(i, token) for token in out.new_token_ids])
        engine.run(door, until_idle=True)

    return build_model, Dist, load_manifest, BLOCK_SIZE, greedy, generate_batch


def older_layout() -> tuple:
    """An older layout's calls, as current_layout's; generate_batch is None (no batched door)."""
    try:  # the engine with its in-process greedy (engine/offline.py)
        from dsconv.runner.engine.offline import greedy
        from dsconv.runner.engine.worker import build_model
        from dsconv.runner.models.dist import Dist
        from dsconv.runner.models.kv_cache import BLOCK_SIZE
        from dsconv.runner.models.weights import load_manifest
    except ImportError:  # the runner as one flat package
        from dsconv.runner.cache import BLOCK_SIZE
        from dsconv.runner.dist import Dist
        from dsconv.runner.engine import build_model
        from dsconv.runner.generate import greedy
        from dsconv.runner.weights import load_manifest
    return build_model, Dist, load_manifest, BLOCK_SIZE, greedy, None


def rss_child(model, new_cache, generate_batch, prompt_len: int) -> None:
    """Prints the peak RSS figures (KiB from ru_maxrss on Linux, printed in MiB) of serving RSS_REQUESTS
    concurrent prompt_len-token requests, after the model's load and at the end."""
    import resource

    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    prompts = [[100 + (7 * i + j) % 500 for j in range(prompt_len)] for i in range(RSS_REQUESTS)]
    generate_batch(model, new_cache, prompts, RSS_NEW_TOKENS, lambda s, t: None, RSS_CHUNK)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"loaded_mib": loaded / 1024, "peak_mib": peak / 1024}), flush=True)


def decode_child(shards: str, new_tokens: int, batch: int = 1, rss_prompt_len: int = 0) -> None:
    """Runs in each side's process: loads the model, then answers every line on stdin with one generation's
    decode tokens/s (of `batch` prompts at once); with rss_prompt_len, prints the peak RSS figures instead and
    ends. Imports whichever layout the side's code has."""
    import torch

    try:
        calls = current_layout()
    except ImportError:
        calls = older_layout()
    build_model, Dist, load_manifest, BLOCK_SIZE, greedy, generate_batch = calls
    import dsconv

    model, _, new_cache = build_model(Path(shards), load_manifest(Path(shards)), 0, Dist(), torch.bfloat16)
    print(json.dumps({"code": str(Path(dsconv.__file__).parent)}), flush=True)
    if rss_prompt_len:
        rss_child(model, new_cache, generate_batch, rss_prompt_len)
        return
    prompts = [list(range(100 + i, 100 + i + PROMPT_LEN)) for i in range(batch)]
    for _ in sys.stdin:
        stamps = []
        if batch == 1:
            greedy(model, new_cache(64 * BLOCK_SIZE), prompts, new_tokens, None,
                   lambda s, t: stamps.append(time.perf_counter()))
        else:
            generate_batch(model, new_cache, prompts, new_tokens, lambda s, t: stamps.append(time.perf_counter()),
                           batch * PROMPT_LEN)
        print(json.dumps({"tok_s": (len(stamps) - batch) / (stamps[-1] - stamps[batch - 1])}), flush=True)


class Side:
    def __init__(self, name: str, code: Path, work: Path):
        self.name, self.code = name, code
        package_dir = work / f"pkg-{name}"
        package_dir.mkdir(parents=True, exist_ok=True)
        link = package_dir / "dsconv"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(code)  # the repository root is the dsconv package directory
        self.env = {**os.environ, "PYTHONPATH": str(package_dir)}


def rss_ab(sides: list[Side], shards: Path, prompt_len: int) -> dict[str, dict]:
    """Each side's peak RSS serving RSS_REQUESTS concurrent prompt_len-token requests, one fresh process each."""
    figures = {}
    for side in sides:
        proc = subprocess.run([sys.executable, __file__, "--decode-child", str(shards), "--rss-prompt-len",
                               str(prompt_len)], capture_output=True, text=True, env=side.env, timeout=1800)
        if proc.returncode:
            raise SystemExit(f"bench_ab: {side.name}'s RSS run failed: {proc.stderr[-2000:]}")
        figures[side.name] = json.loads(proc.stdout.splitlines()[-1])
        got = figures[side.name]
        print(f"  {side.name}: {got['loaded_mib']:.0f} MiB after loading, peak {got['peak_mib']:.0f} MiB "
              f"(+{got['peak_mib'] - got['loaded_mib']:.0f} MiB)", flush=True)
    return figures


def decode_ab(sides: list[Side], shards: Path, new_tokens: int, rounds: int, batch: int = 1
              ) -> dict[str, list[float]]:
    procs = {}
    for side in sides:
        procs[side.name] = subprocess.Popen(
            [sys.executable, __file__, "--decode-child", str(shards), "--new-tokens", str(new_tokens), "--batch",
             str(batch)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=side.env)
        loaded = json.loads(procs[side.name].stdout.readline())
        if Path(loaded["code"]).resolve() != side.code.resolve():
            raise SystemExit(f"bench_ab: the {side.name} process imported dsconv from {loaded['code']}")

    def one(name: str) -> float:
        procs[name].stdin.write("go\n")
        procs[name].stdin.flush()
        return json.loads(procs[name].stdout.readline())["tok_s"]

    for side in sides:
        one(side.name)  # warm-up
    results = {side.name: [] for side in sides}
    for r in range(rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            results[side.name].append(one(side.name))
    for proc in procs.values():
        proc.stdin.close()
        proc.wait(60)
    return results


def world16_ab(sides: list[Side], shards: Path, new_tokens: int, rounds: int, batch: int = 1
               ) -> dict[str, list[float]]:
    """`dsrun generate --json` at world 16 (EP16, lm_head TP16, attention DP16), each side's own CLI, `batch` prompts
    at once (spread over the attention-DP ranks): the decode tokens/s rank 0 reports (generation after the first
    token, over every prompt; the start-up of 16 ranks is not in it)."""
    prompts = [" ".join(f"word{i + j}" for i in range(PROMPT_LEN)) for j in range(batch)]

    def one(side: Side) -> float:
        flags = [arg for prompt in prompts for arg in ("--prompt", prompt)]
        proc = subprocess.run([sys.executable, "-m", "dsconv.runner.cli", "generate", "--shards", str(shards),
                               *flags, "--no-chat", "--json", "--max-new-tokens", str(new_tokens),
                               "--dtype", "bfloat16"], capture_output=True, text=True, env=side.env, timeout=900)
        if proc.returncode:
            raise SystemExit(f"bench_ab: {side.name}'s world-16 run failed: {proc.stderr[-2000:]}")
        return json.loads(proc.stdout)["timings"]["decode_tokens_per_s"]

    results = {side.name: [] for side in sides}
    for r in range(rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            results[side.name].append(one(side))
    return results


def serve_ab(sides: list[Side], shards: Path, work: Path, rounds: int) -> dict[str, list[float]]:
    from contextlib import ExitStack

    from dsconv.scripts import bench_serve  # here: each side process runs this file on its own dsconv

    requests, arrivals = bench_serve.workload(32, (16, 256), (8, 128), float("inf"), 0)
    results = {side.name: [] for side in sides}
    with ExitStack() as stack:
        urls = {side.name: stack.enter_context(bench_serve.serving(
            shards, work / f"serve-{side.name}.log", "--dtype", "bfloat16", "--max-num-seqs", "16", env=side.env))
            for side in sides}

        async def rounds_against_both():
            clients = {name: bench_serve.new_client(url, 8) for name, url in urls.items()}
            models = {name: bench_serve.model_id(url) for name, url in urls.items()}
            for name, client in clients.items():
                await bench_serve.warm_up(client, models[name], requests)
            for r in range(rounds):
                for side in (sides if r % 2 == 0 else sides[::-1]):
                    out, duration = await bench_serve.run_continuous(clients[side.name], models[side.name],
                                                                      requests, arrivals, 8)
                    summary = bench_serve.summarize(out, duration)
                    if summary["failed"]:
                        raise SystemExit(f"bench_ab: {side.name} server failed requests: {summary['errors']}")
                    results[side.name].append(summary["output_throughput"])
            for client in clients.values():
                await client.aclose()

        asyncio.run(rounds_against_both())
    return results


def report(label: str, unit: str, results: dict[str, list[float]]) -> dict:
    base, head = results["base"], results["head"]
    figures = {"base": base, "head": head,
               "median_ratio": statistics.median(head) / statistics.median(base),
               "best_ratio": max(head) / max(base),
               "round_ratios": [h / b for h, b in zip(head, base)]}
    print(f"{label}:")
    for name in ("base", "head"):
        values = results[name]
        print(f"  {name}: median {statistics.median(values):.1f} {unit}, best {max(values):.1f}, "
              f"rounds {', '.join(f'{v:.1f}' for v in values)}")
    ratios = ", ".join(f"{x:.2f}" for x in figures["round_ratios"])
    print(f"  head / base: median {figures['median_ratio']:.3f}, best {figures['best_ratio']:.3f}; "
          f"per round {ratios}", flush=True)
    return figures


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="the revision to compare against (a git commit or branch)")
    parser.add_argument("--family", default="deepseek_v32", choices=["deepseek_v3", "deepseek_v32", "deepseek_v4"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dsrun-bench-ab")
    parser.add_argument("--skip-serve", action="store_true", help="no serve rounds")
    parser.add_argument("--world16-rounds", type=int, default=0,
                        help="also `dsrun generate` at world 16, this many alternating rounds (each starts 16 ranks)")
    parser.add_argument("--world16-batch", type=int, nargs="+", default=[1],
                        help="the world-16 runs with this many prompts at once (one A/B per value)")
    parser.add_argument("--world16-encodings", nargs="+", default=["bf16"], choices=["bf16", "w8a8"],
                        help="the world-16 runs' shards: the tiny checkpoint as made, or quantized to W8A8")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--batch", type=int, nargs="+", default=[1],
                        help="decode runs with this many prompts at once (one A/B per value)")
    parser.add_argument("--rss-prompt-len", type=int, default=0,
                        help=f"also the peak RSS of {RSS_REQUESTS} concurrent requests of this many prompt tokens")
    parser.add_argument("--decode-child", metavar="SHARDS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.decode_child and not args.base:
        parser.error("--base REV is required")
    return args


def world16_figures(args, sides: list[Side], bench_serve) -> dict:
    """The world-16 A/Bs (--world16-rounds): one per --world16-encodings and --world16-batch."""
    from dsconv.family.layout import Layout

    figures = {}
    for encoding in args.world16_encodings if args.world16_rounds else ():
        shards16 = bench_serve.shards_for(args.work, args.family, Layout(), real_vocab=True,
                                          w8a8=encoding == "w8a8")
        for batch in args.world16_batch:
            key = "world16" + ("" if (encoding, batch) == ("bf16", 1) else f"_{encoding}_batch{batch}")
            figures[key] = report(f"decode tokens/s, world 16 (dsrun generate --json), {encoding.upper()} shards, "
                                  f"{args.new_tokens} tokens, {batch} at once", "tok/s",
                                  world16_ab(sides, shards16, args.new_tokens, args.world16_rounds, batch))
    return figures


def run_ab(args, tree: Path) -> dict:
    """Every A/B the arguments ask for, base (checked out at `tree`) against head; returns the figures."""
    from dsconv.family.layout import Layout
    from dsconv.scripts import bench_serve  # here: each side process runs this file on its own dsconv

    sides = [Side("base", tree, args.work), Side("head", REPO, args.work)]
    shards = bench_serve.shards_for(args.work, args.family, Layout(1, 1, 1, 1))
    info = bench_serve.machine(1)
    bench_serve.print_machine(info, 1)
    head_rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    print(f"base {args.base} vs head {head_rev} (+ uncommitted changes, if any); {args.family}, "
          f"{args.rounds} alternating rounds", flush=True)
    figures = {"machine": info, "base": args.base, "head": head_rev}
    for batch in args.batch:
        key = "decode" if batch == 1 else f"decode_batch{batch}"
        figures[key] = report(f"decode tokens/s, world 1, BF16, {args.new_tokens} tokens, {batch} at once",
                              "tok/s", decode_ab(sides, shards, args.new_tokens, args.rounds, batch))
    if args.rss_prompt_len:
        print(f"peak RSS, {RSS_REQUESTS} concurrent requests of {args.rss_prompt_len} prompt tokens:", flush=True)
        figures["rss"] = rss_ab(sides, shards, args.rss_prompt_len)
    figures.update(world16_figures(args, sides, bench_serve))
    if not args.skip_serve:
        figures["serve"] = report("dsrun serve output tokens/s, world 1, 32 requests, concurrency 8", "tok/s",
                                  serve_ab(sides, shards, args.work, args.rounds))
    return figures


def main() -> int:
    args = parse_args()
    if args.decode_child:
        decode_child(args.decode_child, args.new_tokens, args.batch[0], args.rss_prompt_len)
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    tree = args.work / "base-tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), args.base], check=True,
                   capture_output=True)
    try:
        figures = run_ab(args, tree)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
