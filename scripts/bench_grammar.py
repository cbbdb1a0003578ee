"""What grammar masking (constrained decoding, runner/engine/grammar.py) adds to a decode step: 8 sequences decoding
through the scheduler, worker and model in process at world size 1, without a grammar and with each held to a JSON
schema, taking turns for --rounds rounds; the median and fastest step of each side and their ratio.

    python scripts/bench_grammar.py [--family deepseek_v32|deepseek_v4] [--dtype bfloat16] [--rounds 3] [--work DIR]

The model is the tiny random-weight fixture with the real DeepSeek vocabulary (129,280 tokens: the mask is one
bit per vocabulary entry, so a smaller vocabulary would understate its cost). The schema asks for an array of 16
to 64 small objects, so masking runs on every decode step measured; its sequences start with the same
prompts as the unconstrained side's. Greedy on both sides: a draw at temperature > 0 sorts the whole vocabulary,
whose cost changes with how many tokens a mask removed, and would hide the masking's own.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from dsconv.family.layout import Layout
from dsconv.runner.engine.config import EngineConfig, SchedulerConfig
from dsconv.runner.engine.core import new_engine
from dsconv.runner.engine.grammar import Grammars, json_spec
from dsconv.runner.engine.request import SamplingParams
from dsconv.runner.models.registry import DTYPES, build_model
from dsconv.runner.models.dist import Dist
from dsconv.runner.models.weights import load_manifest
from dsconv.scripts.bench_serve import machine, print_machine, shards_for

SEQUENCES = 8
DECODE_STEPS = 40
CACHE_TOKENS = 8192
SCHEMA = {"type": "array", "minItems": 16, "maxItems": 64, "items": {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"},
    "tag": {"type": "string", "enum": ["alpha", "beta", "gamma"]}}, "required": ["id", "ok", "tag"]}}


def decode_steps(model, new_cache, grammars, prompts, grammar) -> list[float]:
    cache = new_cache(CACHE_TOKENS)
    core = new_engine(model, cache, Dist(), EngineConfig(vocab_size=model.cfg.vocab_size, max_model_len=CACHE_TOKENS,
                                                         scheduler=SchedulerConfig(max_num_seqs=SEQUENCES)),
                      grammars=grammars)
    scheduler = core.scheduler
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=DECODE_STEPS + 2, temperature=0.0, seed=i, ignore_eos=True,
                                grammar=grammar)
        scheduler.add(str(i), prompt, params, None)
    core.step()  # the prefill
    times = []
    for _ in range(DECODE_STEPS):
        started = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - started)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="deepseek_v32", choices=["deepseek_v32", "deepseek_v4"])
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/dsrun-bench-grammar"))
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be positive")
    shards = shards_for(args.work, args.family, Layout(1, 1, 1, 1), real_vocab=True)
    print_machine(machine(1), 1)
    manifest = load_manifest(shards)
    config = manifest["model"]["config"]
    model, _, new_cache = build_model(shards, manifest, 0, Dist(), DTYPES[args.dtype])
    grammars = Grammars(shards / "tokenizer.json", config["vocab_size"], config.get("eos_token_id"))
    spec = json_spec(SCHEMA, thinking=False)
    grammars.compile(spec)  # the tokenizer's table and the schema, built before anything is timed
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 100000) for _ in range(rng.randint(16, 128))] for _ in range(SEQUENCES)]
    sides: dict[str, list[float]] = {"no grammar": [], "JSON schema": []}
    print(f"{shards} ({args.family}, {args.dtype}, vocabulary {config['vocab_size']}), {SEQUENCES} sequences, "
          f"{DECODE_STEPS} decode steps per round", flush=True)
    for round_ in range(args.rounds):
        for name, grammar in (("no grammar", None), ("JSON schema", spec)):
            times = decode_steps(model, new_cache, grammars, prompts, grammar)
            sides[name] += times
            print(f"  round {round_ + 1}, {name}: median {1e3 * statistics.median(times):.2f} ms, fastest "
                  f"{1e3 * min(times):.2f} ms", flush=True)
    base, masked = (statistics.median(sides[k]) for k in sides)
    print(f"decode step, {SEQUENCES} sequences: {1e3 * base:.2f} ms without a grammar, {1e3 * masked:.2f} ms with "
          f"one (median of all rounds); ratio {masked / base:.3f}, {1e3 * (masked - base):.2f} ms per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
