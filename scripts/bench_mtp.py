"""MTP speculative decoding (--speculative-config) against none, in one run, on a trained tiny model (V3.2 or V4,
its MTP layer trained with DeepSeek's objective and distilled, tests/mtp_training.py).

    python scripts/bench_mtp.py [--family deepseek_v32|deepseek_v4] [--worlds 1 16] [--ks 1 2 3]
                                [--new-tokens 64] [--rounds 2] [--work DIR] [--json FILE]

For each world size W: the trained checkpoint sharded for DP W x EP W (float32 compute, where greedy verification
gives the tokens of decoding without speculation; in BF16 the verification's extra rows change the rounding, and a
near-tie may go the other way), then `dsrun generate --json --no-chat` on held-out text (the standard library
modules the model never trained on), at batch 1 (one prompt) and with 16 concurrent prompts (at world 16, one per
attention-DP rank), without speculation and with each k. Reported per run:
- how many prompts' tokens equal those without speculation;
- per draft position, the share of verifications whose draft there was accepted;
- the mean acceptance length: tokens per target step (accepted drafts + the target's own);
- decode tokens/s (rank 0's, from the first token to the last; its fastest of --rounds) and the ratio against no
  speculation in the same run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dsconv.family.layout import Layout  # noqa: E402
from dsconv.scripts.bench_serve import machine, print_machine  # noqa: E402
from tests.helpers import shard  # noqa: E402
from tests.trained import heldout_texts, trained_source  # noqa: E402

PROMPT_CHARS = 600
CONCURRENT = 16
CACHE_TOKENS = 16384  # per attention-DP rank: 16 prompts of about 200 tokens and their new tokens at world 1


def prompts(count: int) -> list[str]:
    """`count` held-out passages of PROMPT_CHARS characters, from different places of the held-out modules."""
    text = "\n".join(heldout_texts())
    step = (len(text) - PROMPT_CHARS) // count
    return [text[i * step:i * step + PROMPT_CHARS] for i in range(count)]


def one_run(shards: Path, texts: list[str], k: int, new_tokens: int) -> dict:
    flags = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": k})] if k else []
    command = [sys.executable, "-m", "dsconv.runner.cli", "generate", "--shards", str(shards), "--json", "--no-chat",
               "--max-new-tokens", str(new_tokens), "--dtype", "float32", "--cache-tokens", str(CACHE_TOKENS), *flags,
               *[arg for text in texts for arg in ("--prompt", text)]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"dsrun generate failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["deepseek_v32", "deepseek_v4"], default="deepseek_v32")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dsconv-bench-mtp")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    print_machine(machine(max(args.worlds)), max(args.worlds))
    results = {}
    for world in args.worlds:
        shards = args.work / f"{args.family}-w{world}"
        if not (shards / "manifest.json").exists():
            shard(trained_source(args.family), shards, Layout(world, world, world, 1))
        for batch in (1, CONCURRENT):
            texts = prompts(batch)
            base = None
            print(f"world {world}, {batch} prompt{'s' if batch > 1 else ''}:", flush=True)
            for k in [0, *args.ks]:
                runs = [one_run(shards, texts, k, args.new_tokens) for _ in range(args.rounds)]
                report = max(runs, key=lambda r: r["timings"]["decode_tokens_per_s"])
                base = base or report
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
                results[f"w{world} batch{batch} k{k}"] = row
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(max(args.worlds)), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
