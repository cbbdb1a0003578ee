"""Context-parallel prefill: time to first token of one long prompt at world 2 with a CP group of 2 against none,
each rank's peak memory while prefilling, and, on paper, DeepSeek-V3.2's per-rank prefill work and gathered bytes
at 64K tokens for CP 16 against one attention-DP rank doing it all.

    python scripts/bench_cp.py [--tokens 4096] [--rounds 3] [--dtype float32] [--work DIR]

Measured: `dsrun generate`'s ranks (tiny V3.2, random weights, world 2, EP 2, lm_head TP 2), one prompt pinned to
DP rank 0, one new token: rank 0's time from submitting the prompt to its first token, and each rank's peak RSS
above what it held once its model was loaded (ru_maxrss), fastest of --rounds rounds, CP 1 and CP 2 alternating.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
from pathlib import Path

from dsconv.comm.launch import launch
from dsconv.convert.tiny_checkpoint import make_tiny_checkpoint
from dsconv.family.arch import family_for
from dsconv.family.layout import Layout
from dsconv.runner.engine import core
from dsconv.runner.engine.config import CacheConfig, RunConfig, SchedulerConfig
from dsconv.runner.entrypoints.generate import gather_to_rank0, generate
from dsconv.runner.models.weights import load_manifest
from dsconv.scripts.bench_serve import machine, print_machine
from dsconv.shard.shard import make_shard_plan, run_shard

REPO = Path(__file__).resolve().parents[1]

WORLD = 2
REAL_CONFIG = REPO / "tests" / "data" / "deepseek_v32_exp.config.json"
PAPER_TOKENS = 65536
PAPER_CP = 16
ENTRY_BYTES = 2  # BF16 cache entries gathered


def rank_entry(run: RunConfig, prompts, max_new_tokens, record: str) -> None:
    """dsrun generate's ranks, with each rank's peak RSS above its loaded model: rank 0 writes its time to the
    first token and every rank's peak to `record`."""
    loaded = {}
    start_rank = core.start_rank

    def start_and_measure(*args, **kw):
        out = start_rank(*args, **kw)
        loaded["kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return out

    core.start_rank = start_and_measure
    result = generate(run, prompts, max_new_tokens)
    peaks = gather_to_rank0((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - loaded["kib"]) / 1024)
    if result is not None:
        Path(record).write_text(json.dumps([{"prefill_s": result.prefill_s, "prefill_peak_mib": peak}
                                            for peak in peaks]))


def run(shards: Path, prompt: list[int], cp_size: int, dtype: str, results: Path) -> list[dict]:
    results.mkdir(parents=True, exist_ok=True)
    config = RunConfig(shards, load_manifest(shards), dtype, "cpu", CacheConfig(len(prompt) + 16),
                       SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=len(prompt), cp_size=cp_size,
                                       cp_min_tokens=len(prompt)))
    code = launch(rank_entry, {"run": config, "prompts": [prompt], "max_new_tokens": 1,
                               "record": str(results / "rank0.json")},
                  world_size=WORLD, device="cpu", timeout_s=600.0, log_dir=results / "logs")
    if code:
        raise SystemExit(f"the ranks failed (exit {code}); logs in {results / 'logs'}")
    return json.loads((results / "rank0.json").read_text())


def on_paper() -> None:
    """DeepSeek-V3.2's prefill of PAPER_TOKENS tokens: per-rank multiply-adds of attention (projections, indexer,
    attention core in the form the runner picks) and the bytes each rank receives from the CP gathers."""
    raw = json.loads(REAL_CONFIG.read_text())
    cfg = family_for(raw).parse_config(raw)
    hidden, heads, lora, rope = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v, k = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.index_topk
    per_token = (hidden * cfg.q_lora_rank + cfg.q_lora_rank * heads * (nope + rope) + hidden * (lora + rope)
                 + heads * v * hidden + cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim
                 + hidden * (cfg.index_head_dim + cfg.index_n_heads))

    def attention_macs(queries: list[int]) -> float:
        """queries: each query's context length (its position + 1); the cheaper of the two forms per query."""
        total = 0.0
        for context in queries:
            indexer = cfg.index_n_heads * context * cfg.index_head_dim if context > k else 0
            absorbed = heads * lora * (nope + v) + heads * min(k, context) * (2 * lora + rope)
            expanded = heads * context * (nope + rope + v)  # the expansion itself, shared, is left out: a floor
            total += per_token + indexer + min(absorbed, expanded)
        return total

    step = 64  # sample every 64th position: the sums are smooth in the position
    dp = attention_macs(list(range(1, PAPER_TOKENS + 1, step))) * step
    from dsconv.runner.engine.batch import cp_positions
    cp = max(attention_macs([p + 1 for p in cp_positions(PAPER_TOKENS, PAPER_CP, m)][::step]) * step
             for m in range(PAPER_CP))
    row = (lora + rope + cfg.index_head_dim) * ENTRY_BYTES
    gathered = row * PAPER_TOKENS * (PAPER_CP - 1) / PAPER_CP * cfg.num_hidden_layers
    print(f"on paper, DeepSeek-V3.2 at {PAPER_TOKENS} tokens, attention over its {cfg.num_hidden_layers} "
          f"layers: one DP rank {dp * cfg.num_hidden_layers / 1e12:.1f} T multiply-adds; CP {PAPER_CP}, the busiest "
          f"rank {cp * cfg.num_hidden_layers / 1e12:.2f} T ({dp / cp:.1f}x less), receiving {gathered / 2**30:.2f} GiB "
          f"of gathered latent + indexer keys ({row} B a token and layer). The MoE's work per rank is the same "
          f"either way (EP {PAPER_CP} spreads the tokens' experts over every rank).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    print_machine(machine(WORLD), WORLD)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-cp-"))
    src, shards = work / "src", work / "shards"
    if not (src / "config.json").exists():
        make_tiny_checkpoint(src, "deepseek_v32")
    if not (shards / "manifest.json").exists():
        run_shard(make_shard_plan(src, Layout(WORLD, WORLD, WORLD, 1), 4 * 10**9), shards, 1, lambda n: None)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompt = [rng.randrange(2, vocab) for _ in range(args.tokens)]
    ttft: dict[int, list[float]] = {1: [], 2: []}
    peaks: dict[int, list[float]] = {1: [], 2: []}
    for round_ in range(args.rounds):
        for size in (1, 2):
            records = run(shards, prompt, size, args.dtype, work / f"r{round_}-cp{size}")
            ttft[size].append(records[0]["prefill_s"])
            peaks[size] = [min(old, r["prefill_peak_mib"]) for old, r in zip(peaks[size], records)] if peaks[size] \
                else [r["prefill_peak_mib"] for r in records]
            print(f"round {round_}: CP {size}: TTFT {records[0]['prefill_s']:.2f} s", flush=True)
    one, two = min(ttft[1]), min(ttft[2])
    print(f"{args.tokens} tokens at world {WORLD}: TTFT CP 1 {one:.2f} s, CP 2 {two:.2f} s: {one / two:.2f}x faster; "
          f"peak MiB above the loaded model per rank: CP 1 {[round(p) for p in peaks[1]]}, "
          f"CP 2 {[round(p) for p in peaks[2]]}")
    on_paper()


if __name__ == "__main__":
    main()
