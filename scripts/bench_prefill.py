"""V3.2 prefill attention two ways, at one 4,096-token prompt on CPU: the latent expanded through W_UK / W_UV with
the indexer's choice as a mask over the whole context, against the absorbed form over each query's own
index_topk latent rows (runner/models/deepseek_v3.py, `Attention.prefill`).

    python scripts/bench_prefill.py [--tokens 4096] [--rounds 3] [--dtype float32] [--work DIR]

Two regimes of the indexer's k against the context: the tiny config's index_topk of 8 (k far below the context,
as DeepSeek-V3.2's 2048 is at long contexts), and 2048 (half of 4,096, DeepSeek-V3.2's own k at this length).
Each prefill runs as one step through the scheduler, worker and model at world size 1 on the tiny V3.2 shapes
(random weights); the fastest of --rounds rounds per path, their ratio, and the path `absorbed_is_cheaper`
(the multiply-add count the runner decides by) picks, which should be the faster one.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from unittest import mock

from dsconv.convert.tiny_checkpoint import make_tiny_checkpoint
from dsconv.family.layout import Layout
from dsconv.runner.engine.config import EngineConfig, SchedulerConfig
from dsconv.runner.engine.core import new_engine
from dsconv.runner.engine.request import SamplingParams
from dsconv.runner.models.registry import DTYPES, build_model
from dsconv.runner.models.deepseek_v3 import Attention
from dsconv.runner.models.dist import Dist
from dsconv.runner.models.weights import load_manifest
from dsconv.scripts.bench_serve import machine, print_machine
from dsconv.shard.shard import make_shard_plan, run_shard

REGIMES = (8, 2048)  # index_topk: far below the prompt, and half of it


def prefill_seconds(model, new_cache, prompt: list[int], absorbed: bool) -> float:
    """One step that prefills `prompt` whole (and samples its first token), with the path forced."""
    cache = new_cache(len(prompt) + 16)
    engine = new_engine(model, cache, Dist(), EngineConfig(
        vocab_size=model.cfg.vocab_size, max_model_len=len(prompt) + 16,
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=len(prompt))))
    engine.scheduler.add("p", prompt, SamplingParams(max_tokens=1), None)
    with mock.patch.object(Attention, "absorbed_is_cheaper", lambda self, queries, context: absorbed):
        started = time.perf_counter()
        engine.step()
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--work", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    args = parser.parse_args()
    print_machine(machine(1), 1)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-prefill-"))
    rng = random.Random(0)
    for topk in REGIMES:
        src = work / f"k{topk}" / "src"
        if not (src / "config.json").exists():
            make_tiny_checkpoint(src, "deepseek_v32", config_overrides={"index_topk": topk})
        shards = work / f"k{topk}" / "shards"
        if not (shards / "manifest.json").exists():
            run_shard(make_shard_plan(src, Layout(1, 1, 1, 1), 4 * 10**9), shards, 1, lambda n: None)
        model, _, new_cache = build_model(shards, load_manifest(shards), 0, Dist(), DTYPES[args.dtype])
        prompt = [rng.randrange(2, model.cfg.vocab_size) for _ in range(args.tokens)]
        times = {"expanded": [], "absorbed": []}
        for _ in range(args.rounds):
            for path in times:
                times[path].append(prefill_seconds(model, new_cache, prompt, path == "absorbed"))
        expanded, absorbed = min(times["expanded"]), min(times["absorbed"])
        attention = model.layers[0].attn
        picks = "absorbed" if attention.absorbed_is_cheaper(args.tokens, args.tokens) else "expanded"
        faster = "absorbed" if absorbed < expanded else "expanded"
        print(f"index_topk {topk:4d}, {args.tokens} tokens: expanded {expanded:6.2f} s, absorbed {absorbed:6.2f} s "
              f"(expanded / absorbed {expanded / absorbed:.2f}); the count picks {picks}, the faster is {faster}",
              flush=True)


if __name__ == "__main__":
    main()
