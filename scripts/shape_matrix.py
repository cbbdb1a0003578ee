"""The shape matrix: real runs of dsrun at world 16 record what their steps covered (`--record-shapes`), and
docs/shape_matrix.md is rendered from those rows, never written by hand.

    python scripts/shape_matrix.py                  # run the matrix (a few minutes on 2 cores), then render
    python scripts/shape_matrix.py --render-only    # render docs/shape_matrix.md from docs/shape_matrix.jsonl

The runs use tiny checkpoints in the hub's formats with the real vocabulary (random weights: the shapes, not the
text, are the point), quantized to W8A8 where the row says so:
  - V4: W8A8 at attention DP16 / EP16 / lm_head TP16 (the demo's shards), prompts past an HCA window (128) so that
    every compression ratio completes entries, generate with both cache dtypes and perplexity;
  - V3.2: W8A8 at attention DP2 x TP8, and at DP16 with o_proj and embedding TP16, prompts past index_topk (the
    indexer selects); BF16 at DP16 with a context-parallel prefill.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROWS = REPO / "docs" / "shape_matrix.jsonl"
OUT = REPO / "docs" / "shape_matrix.md"
NEW_TOKENS = 24
FILE_BYTES = 1_000_000  # the output files' cap: several files even for these tiny checkpoints


def prompt_text(chars: int, offset: int = 0) -> str:
    """Python's own source as prompt text: it tokenizes to about one token per 3 to 4 characters."""
    import textwrap

    source = Path(textwrap.__file__).read_text(encoding="utf-8")
    return source[offset:offset + chars]


def dsrun(command: str, shards: Path, rows: Path, *args) -> None:
    cmd = [sys.executable, "-m", "dsconv.runner.cli", command, "--shards", str(shards), "--record-shapes", str(rows),
           *map(str, args)]
    print("+", " ".join(cmd[3:6]), "...", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def quantize(src: Path, out: Path) -> None:
    """`dsconv quantize` (the default recipe, ascend format) on two workers."""
    from dsconv.convert.quantize import build_plan, run_quantize

    run_quantize(build_plan(src, None, "ascend", FILE_BYTES), out, workers=2, on_progress=lambda n: None)


def shard(src: Path, out: Path, layout) -> None:
    """`dsconv shard` for `layout` on two workers."""
    from dsconv.shard.shard import make_shard_plan, run_shard

    run_shard(make_shard_plan(src, layout, FILE_BYTES), out, 2, lambda n: None)


def build_shards(scratch: Path) -> dict[str, Path]:
    from dsconv.convert.tiny_checkpoint import make_tiny_checkpoint
    from dsconv.family.layout import Layout
    from dsconv.shard.demo import demo_shards

    v32 = make_tiny_checkpoint(scratch / "v32", "deepseek_v32", encoding="fp8", real_vocab=True)
    quantize(v32, scratch / "v32-w8a8")
    out = {"v4-w8a8-dp16": demo_shards()}
    for name, source, layout in (
            ("v32-w8a8-dp2tp8", scratch / "v32-w8a8", Layout(16, 16, 16, 8)),
            ("v32-w8a8-dp16-fine", scratch / "v32-w8a8", Layout(16, 16, 16, 1, oproj_tp=16, embed_tp=16)),
            ("v32-bf16-dp16", v32, Layout(16, 16, 16, 1))):
        shard(source, scratch / name, layout)
        out[name] = scratch / name
    return out


def run_matrix(rows: Path) -> None:
    rows.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="shape-matrix-") as tmp:
        scratch = Path(tmp)
        shards = build_shards(scratch)
        long_prompts = ["--prompt", prompt_text(900), "--prompt", prompt_text(500, 2000), "--prompt", "Hello"]
        for kv in ("auto", "int8"):
            dsrun("generate", shards["v4-w8a8-dp16"], rows, *long_prompts, "--no-chat", "--max-new-tokens",
                  NEW_TOKENS, "--kv-cache-dtype", kv)
        text = scratch / "text.txt"
        text.write_text(prompt_text(6000))
        dsrun("perplexity", shards["v4-w8a8-dp16"], rows, "--file", text, "--context", 300)
        for name in ("v32-w8a8-dp2tp8", "v32-w8a8-dp16-fine"):
            dsrun("generate", shards[name], rows, *long_prompts, "--no-chat", "--max-new-tokens", NEW_TOKENS)
        dsrun("generate", shards["v32-w8a8-dp16-fine"], rows, *long_prompts, "--no-chat", "--max-new-tokens",
              NEW_TOKENS, "--kv-cache-dtype", "int8")
        dsrun("perplexity", shards["v32-bf16-dp16"], rows, "--file", text, "--context", 300,
              "--prefill-context-parallel-size", 2, "--prefill-cp-min-tokens", 64)


def layout_of(row: dict) -> str:
    fine = "".join(f", {name} TP{row[key]}" for name, key in (("o_proj", "oproj_tp"), ("embedding", "embed_tp"))
                   if row[key] > 1)
    return f"DP{row['attention_dp']} x TP{row['attention_tp']}, EP{row['ep']}, lm_head TP{row['lm_head_tp']}{fine}"


def render(rows: list[dict]) -> str:
    lines = [
        "# Shape matrix", "",
        "Rendered by `scripts/shape_matrix.py` from the rows real `dsrun` runs appended with `--record-shapes` "
        "(`docs/shape_matrix.jsonl`); not edited by hand. Each row is one run at world 16 on a tiny checkpoint in the "
        "hub's formats with the real vocabulary. `handoff`: how attention rows reach the MoE exchange (`direct`: each "
        "attention-DP rank routes its own rows; `tp-share`: each rank of an attention-TP group routes an equal share). "
        "Ratios: the compression ratios of the layers that ran in prefill / decode rows (V4: 0 sliding window, 4 CSA, "
        "128 HCA; none for MLA). Crossed: blocks completed, and V4's sliding and compression windows completed; "
        "V3.2's rows whose context passed index_topk, and its context-parallel prefills.", "",
        "| command | model | weights | layout | handoff | dtype | KV cache | prompt lengths | batch | ratios prefill / "
        "decode | crossed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratios = " / ".join(",".join(map(str, row["compression_ratios"][kind])) or "-"
                            for kind in ("prefill", "decode"))
        crossed = ", ".join(f"{name.replace('compression_windows_ratio_', 'ratio-')} {count}"
                            for name, count in row["boundaries_crossed"].items())
        lengths = ", ".join(map(str, row["prompt_lengths"][:6])) + (" ..." if len(row["prompt_lengths"]) > 6 else "")
        lines.append(f"| {row['command']} | {row['family']} | {row['weights']} | {layout_of(row)} | {row['handoff']} "
                     f"| {row['dtype']} | {row['kv_cache_dtype']} | {lengths} | {row['batch_size']} | {ratios} | "
                     f"{crossed} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render-only", action="store_true", help="render from the existing rows, run nothing")
    args = parser.parse_args()
    os.chdir(REPO)
    if not args.render_only:
        run_matrix(ROWS)
    rows = [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()]
    OUT.write_text(render(rows))
    print(f"{OUT}: {len(rows)} rows")


if __name__ == "__main__":
    main()
