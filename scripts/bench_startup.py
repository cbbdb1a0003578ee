"""How long `dsrun generate` takes from the command line to its exit, with the ranks' fork server started first
thing in the command (comm/forkserver.py) against the same command with that start left to the launch, in one run.

    python scripts/bench_startup.py [--rounds 5] [--world 1 16] [--work DIR]

A tiny V3.2 checkpoint (random weights, real vocabulary) is sharded for each --world; each round runs
`dsrun generate --max-new-tokens 1` once each way, alternating, so both meet the same machine load. The baseline
is the same code with `start_rank_server` replaced by a no-op before the CLI loads. It prints the machine, each
way's median and best wall time, and early / baseline.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CLI = "from dsconv.runner.cli import app; app(prog_name='dsrun')"
BASELINE = "import dsconv.comm.forkserver as f; f.start_rank_server = lambda *a: None; " + CLI


def shards_for(work: Path, world: int) -> Path:
    from dsconv.convert.tiny_checkpoint import make_tiny_checkpoint
    from dsconv.family.layout import Layout
    from dsconv.shard.shard import make_shard_plan, run_shard

    source = work / "source"
    if not (source / "config.json").exists():
        make_tiny_checkpoint(source, "deepseek_v32", real_vocab=True)
    out = work / f"shards-w{world}"
    if not (out / "manifest.json").exists():
        run_shard(make_shard_plan(source, Layout(world, world, world, 1), 4 * 10**9), out, 2, lambda n: None)
    return out


def wall(code: str, shards: Path) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, "generate", "--shards", str(shards), "--prompt", "hi",
                    "--max-new-tokens", "1", "--json"], check=True, capture_output=True, cwd=REPO)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--world", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_startup"))
    args = parser.parse_args()
    from dsconv.kernels.device import cpu_model_and_flags

    model, _ = cpu_model_and_flags()
    print(f"machine: {model}, {os.cpu_count()} cores; torch {torch.__version__}")
    for world in args.world:
        shards = shards_for(args.work, world)
        wall(CLI, shards)  # one run first: the page cache warm for both ways
        times = {"early": [], "baseline": []}
        for _ in range(args.rounds):
            times["early"].append(wall(CLI, shards))
            times["baseline"].append(wall(BASELINE, shards))
        for way, spans in times.items():
            print(f"world {world}, {way}: median {statistics.median(spans):.2f} s, best {min(spans):.2f} s")
        ratio = statistics.median(times["early"]) / statistics.median(times["baseline"])
        print(f"world {world}: early / baseline {ratio:.3f} (median)")


if __name__ == "__main__":
    main()
