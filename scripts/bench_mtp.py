"""MTP speculative decoding (--speculative-config) against none, in one run, on a checkpoint with an MTP layer:
made for the trained tiny models (V3.2 or V4, their MTP layer trained with DeepSeek's objective and distilled,
tests/mtp_training.py), whose figures docs/benchmarks.md records.

    python scripts/bench_mtp.py --source DIR --text FILE [FILE ...] [--worlds 1 16] [--ks 1 2 3]
                                [--new-tokens 64] [--rounds 2] [--work DIR] [--json FILE]

--source: a checkpoint in the hub's layout whose config has num_nextn_predict_layers >= 1, with its tokenizer.
--text: the files the prompts are cut from (text the model did not train on). The trained tiny models and their
held-out text come from the repository's tests (run from its root; the model is derived on first use):

    python scripts/bench_mtp.py --source "$(python -m tests.tools.trained_model deepseek_v32)" \\
        --text $(python -m tests.tools.trained_model --heldout)

For each world size W: the checkpoint sharded for DP W x EP W (float32 compute, where greedy verification gives
the tokens of decoding without speculation; in BF16 the verification's extra rows change the rounding, and a
near-tie may go the other way), once under --work (keyed by --source's path; delete it after changing a
checkpoint in place), then `dsrun generate --json --no-chat` on the --text passages, at batch 1 (one prompt) and
with 16 concurrent prompts (at world 16, one per attention-DP rank), without speculation and with each k.
Reported per run:
- how many prompts' tokens equal those without speculation;
- per draft position, the share of verifications whose draft there was accepted;
- the mean acceptance length: tokens per target step (accepted drafts + the target's own);
- decode tokens/s (rank 0's, from the first token to the last; its fastest of --rounds) and the ratio against no
  speculation in the same run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from dsconv.family.layout import Layout
from dsconv.scripts.bench_serve import machine, print_machine
from dsconv.shard.shard import make_shard_plan, run_shard

PROMPT_CHARS = 600
CONCURRENT = 16
CACHE_TOKENS = 16384  # per attention-DP rank: 16 prompts of about 200 tokens and their new tokens at world 1
FILE_BYTES = 4 * 10**9  # the shards' file cap


def prompts(files: list[Path], count: int) -> list[str]:
    """`count` passages of PROMPT_CHARS characters, from different places of the files' text (joined by newlines)."""
    text = "\n".join(path.read_text(encoding="utf-8") for path in files)
    step = (len(text) - PROMPT_CHARS) // count
    if step < 0:
        raise SystemExit(f"bench_mtp: --text holds {len(text)} characters, fewer than one prompt's {PROMPT_CHARS}")
    return [text[i * step:i * step + PROMPT_CHARS] for i in range(count)]


def shards_for(work: Path, source: Path, world: int) -> Path:
    """`source` sharded for DP world x EP world, once under `work` (keyed by the source's path)."""
    key = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:12]
    shards = work / f"{source.resolve().parent.name}-{source.name}-{key}-w{world}"
    if not (shards / "manifest.json").exists():
        run_shard(make_shard_plan(source, Layout(world, world, world, 1), FILE_BYTES), shards, 2, lambda n: None)
    return shards


def one_run(shards: Path, texts: list[str], k: int, new_tokens: int) -> dict:
    flags = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": k})] if k else []
    command = [sys.executable, "-m", "dsconv.runner.cli", "generate", "--shards", str(shards), "--json", "--no-chat",
               "--max-new-tokens", str(new_tokens), "--dtype", "float32", "--cache-tokens", str(CACHE_TOKENS), *flags,
               *[arg for text in texts for arg in ("--prompt", text)]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"dsrun generate failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args() -> argparse.Namespace:
    doc = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(description=doc[0], epilog="\n\n".join(doc[2:4]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, required=True,
                        help="a checkpoint (hub layout) with an MTP layer: num_nextn_predict_layers >= 1")
    parser.add_argument("--text", type=Path, nargs="+", required=True, help="the files the prompts are cut from")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dsconv-bench-mtp")
    parser.add_argument("--json", type=Path)
    return parser.parse_args()


def one_row(report: dict, base: dict, k: int, batch: int) -> dict:
    """The figures of one k's fastest run against no speculation's (`base`), printed as one line."""
    same = sum(a == b for a, b in zip(report["generated_token_ids"], base["generated_token_ids"]))
    tps = report["timings"]["decode_tokens_per_s"]
    ratio = tps / base["timings"]["decode_tokens_per_s"]
    row = {"decode_tokens_per_s": tps, "ratio": ratio, "same_tokens": f"{same}/{batch}"}
    spec = report["speculative"]
    if spec is None:
        print(f"  no speculation: decode {tps:7.1f} tok/s", flush=True)
    else:
        rates = [count / spec["num_drafts"] for count in spec["accepted_per_pos"]]
        row.update(mean_acceptance_length=spec["mean_acceptance_length"], acceptance_per_pos=rates)
        print(f"  k={k}: decode {tps:7.1f} tok/s ({ratio:.2f}x), mean acceptance length "
              f"{spec['mean_acceptance_length']:.2f}, per position "
              f"{' / '.join(f'{r:.2f}' for r in rates)}; tokens as without: {same}/{batch}", flush=True)
    return row


def main() -> int:
    args = parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    print_machine(machine(max(args.worlds)), max(args.worlds))
    results = {}
    for world in args.worlds:
        shards = shards_for(args.work, args.source, world)
        for batch in (1, CONCURRENT):
            texts = prompts(args.text, batch)
            base = None
            print(f"world {world}, {batch} prompt{'s' if batch > 1 else ''}:", flush=True)
            for k in [0, *args.ks]:
                runs = [one_run(shards, texts, k, args.new_tokens) for _ in range(args.rounds)]
                report = max(runs, key=lambda r: r["timings"]["decode_tokens_per_s"])
                base = base or report
                results[f"w{world} batch{batch} k{k}"] = one_row(report, base, k, batch)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(max(args.worlds)), "source": str(args.source),
                                         "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
