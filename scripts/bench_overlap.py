"""Step time with the MoE's shared expert overlapped with the expert exchange and without it
(--no-overlap-shared-experts), in one run, on CPU ranks over gloo.

    python scripts/bench_overlap.py [--family deepseek_v32|deepseek_v4] [--worlds 2 4 16] [--rounds 3]
                                    [--new-tokens 16] [--prompt-words 96] [--work DIR] [--json FILE]
    python scripts/bench_overlap.py --paper [--config CONFIG.json] [--sequences 64] [--link-gbps 200]
                                    [--int8-tops 640] [--hbm-tbps 1.6]

For each world size W: the family's tiny checkpoint (DeepSeek's real vocabulary, random weights) sharded for
DP W x EP W, then `dsrun generate --json` with W prompts (one per attention-DP rank, so every rank computes) run
alternately with and without overlap, --rounds times each. Prefill: the one step that prefills every prompt; decode:
the mean step after it (W sequences a step). Each side's fastest round is reported, and the ratio without / with
(above 1: overlap is faster).

On a 2-core machine 16 ranks share 2 cores: gloo's thread and the main thread of every rank compete for them, so the
exchange the overlap would hide is itself waiting for a core. The ratios are what this machine gives, not a
prediction for accelerators with their own links (docs/benchmarks.md, "Overlap", has the estimate for real V3.2 at
EP16).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from dsconv.comm.collectives import header_rows
from dsconv.family.layout import Layout
from dsconv.runner.models.moe import DEVICE_LINK_PAD_BYTES, dispatch_columns, row_bytes
from dsconv.scripts.bench_serve import machine, print_machine, shards_for

REPO = Path(__file__).resolve().parents[1]

WORDS = ("the forbidden city in beijing was home to emperors for five centuries and its halls hold a "
         "collection of paintings bronzes ceramics and clocks").split()


def prompt(index: int, words: int) -> str:
    """A prompt of `words` words, different for each index (so no two ranks run the same tokens)."""
    return " ".join(WORDS[(index * 7 + i) % len(WORDS)] for i in range(words))


def one_run(shards: Path, world: int, overlap: bool, new_tokens: int, words: int) -> dict:
    """dsrun generate on the shards -> {"prefill_ms", "decode_ms"}: the prefill step and the mean decode step."""
    flag = "--overlap-shared-experts" if overlap else "--no-overlap-shared-experts"
    prompts = [arg for i in range(world) for arg in ("--prompt", prompt(i, words))]
    command = [sys.executable, "-m", "dsconv.runner.cli", "generate", "--shards", str(shards), "--json", "--no-chat",
               "--max-new-tokens", str(new_tokens), "--dtype", "bfloat16", flag, *prompts]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"dsrun generate failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if report["overlap_shared_experts"] != overlap:
        raise SystemExit(f"asked for overlap={overlap}, the run reports {report['overlap_shared_experts']}")
    timings = report["timings"]
    prompt_tokens = sum(map(len, report["prompt_token_ids"]))
    return {"prefill_ms": 1000 * prompt_tokens / timings["prefill_tokens_per_s"],
            "decode_ms": 1000 * world / timings["decode_tokens_per_s"]}


# --paper: what one decode step of real V3.2 at EP16 exchanges, and what its shared experts can hide --------------
V32_CONFIG = REPO / "tests" / "data" / "deepseek_v32_exp.config.json"  # DeepSeek-V3.2-Exp's config.json
EP = 16
COMBINE_BYTES = 2  # the combine returns BF16 rows


def wire_row_bytes(hidden: int) -> int:
    """A W8A8 dispatch row's bytes: INT8 activations, their float32 scale, the local expert id (models/moe.py)."""
    rows = torch.ones(1, hidden, dtype=torch.bfloat16)
    return sum(row_bytes(c) for c in dispatch_columns(rows, torch.zeros(1, dtype=torch.long), True))


def paper(config: dict, sequences: int, link_gbps: float, int8_tops: float, hbm_tbps: float) -> dict:
    """Per decode step on one rank of EP16 with `sequences` one-token sequences: the bytes its MoE exchanges send
    (dispatch: INT8 rows with their scale and expert id; combine: BF16 rows), the part that leaves the rank (15 of
    16 experts live elsewhere, with routing spread evenly), their time on the link, and the shared experts' time:
    their INT8 multiply-adds at the card's peak and the reading of their INT8 weights at its HBM bandwidth.
    The dispatch's form is the one models/moe.py picks on a device link: counted (one all-to-all, every peer's block
    padded to `sequences` x k rows plus its header) while that stays within DEVICE_LINK_PAD_BYTES, else variable
    (the counts exchanged first, then only the real rows)."""
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"] * config["n_shared_experts"]
    k = config["num_experts_per_tok"]
    moe_layers = config["num_hidden_layers"] - config["first_k_dense_replace"]
    rows, width = sequences * k, wire_row_bytes(hidden)
    padded = EP * (header_rows(width) + rows) * width  # the counted form's blocks: capacity = sequences x k
    counted = padded <= DEVICE_LINK_PAD_BYTES
    dispatch = padded if counted else rows * width
    combine = rows * hidden * COMBINE_BYTES
    leaving = (dispatch + combine) * (EP - 1) / EP
    link_s = leaving / (link_gbps * 1e9 / 8)
    shared_ops = 2 * sequences * 3 * hidden * inter  # gate, up and down: 2 ops per multiply-add
    shared_weights = 3 * hidden * inter  # INT8 bytes
    compute_s, weights_s = shared_ops / (int8_tops * 1e12), shared_weights / (hbm_tbps * 1e12)
    per_layer = {"dispatch_bytes": dispatch, "combine_bytes": combine, "leaving_bytes": leaving, "link_us": 1e6 * link_s,
                 "exchanges": 2 if counted else 3, "shared_ops": shared_ops, "shared_compute_us": 1e6 * compute_s,
                 "shared_weight_read_us": 1e6 * weights_s,
                 "shared_us": 1e6 * max(compute_s, weights_s)}
    return {"moe_layers": moe_layers, "sequences": sequences, "row_bytes": width, "bf16_row_bytes": 2 * hidden + 8,
            "dispatch_form": "counted" if counted else "variable", "counted_padded_bytes": padded,
            "per_layer": per_layer, "per_step": {name: value * moe_layers for name, value in per_layer.items()},
            "hidden_fraction": min(1.0, max(compute_s, weights_s) / link_s)}


def print_paper(estimate: dict, link_gbps: float, int8_tops: float, hbm_tbps: float) -> None:
    layer, step = estimate["per_layer"], estimate["per_step"]
    print(f"real V3.2 at EP16, one decode step with {estimate['sequences']} sequences per rank, "
          f"{estimate['moe_layers']} MoE layers; link {link_gbps:g} Gb/s, INT8 {int8_tops:g} TOPS, HBM {hbm_tbps:g} TB/s")
    print(f"  dispatch rows: {estimate['row_bytes']} B (INT8 with scale and expert id) against "
          f"{estimate['bf16_row_bytes']} B in BF16 ({estimate['row_bytes'] / estimate['bf16_row_bytes']:.3f}x); "
          f"form: {estimate['dispatch_form']}, {layer['exchanges']} exchanges a layer (counted blocks would be "
          f"{estimate['counted_padded_bytes'] / 1e6:.2f} MB)")
    print(f"  per layer: dispatch {layer['dispatch_bytes'] / 1e6:.2f} MB + combine {layer['combine_bytes'] / 1e6:.2f} MB, "
          f"{layer['leaving_bytes'] / 1e6:.2f} MB leave the rank: {layer['link_us']:.0f} us on the link")
    print(f"  shared expert per layer: {layer['shared_ops'] / 1e9:.2f} G INT8 ops, {layer['shared_compute_us']:.1f} us "
          f"at peak; its weights read in {layer['shared_weight_read_us']:.1f} us: {layer['shared_us']:.1f} us")
    print(f"  per step: {step['leaving_bytes'] / 1e6:.0f} MB, {step['link_us'] / 1e3:.1f} ms on the link; the shared "
          f"experts hide {step['shared_us'] / 1e3:.2f} ms of it ({100 * estimate['hidden_fraction']:.1f}%)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paper", action="store_true", help="Print the estimate for real V3.2 at EP16 and exit.")
    parser.add_argument("--config", type=Path, default=V32_CONFIG)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--link-gbps", type=float, default=200.0)
    parser.add_argument("--int8-tops", type=float, default=640.0)
    parser.add_argument("--hbm-tbps", type=float, default=1.6)
    parser.add_argument("--family", default="deepseek_v32", choices=["deepseek_v32", "deepseek_v3", "deepseek_v4"])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=96)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dsconv-bench-overlap")
    parser.add_argument("--json", type=Path, help="Also write the figures to this file.")
    args = parser.parse_args()
    if args.paper:
        estimate = paper(json.loads(args.config.read_text()), args.sequences, args.link_gbps, args.int8_tops,
                         args.hbm_tbps)
        print_paper(estimate, args.link_gbps, args.int8_tops, args.hbm_tbps)
        if args.json:
            args.json.write_text(json.dumps(estimate, indent=1))
        return 0
    info = machine(max(args.worlds))
    print_machine(info, max(args.worlds))
    results = {"machine": info, "family": args.family, "rounds": args.rounds, "worlds": {}}
    for world in args.worlds:
        shards = shards_for(args.work, args.family, Layout(world, world, world, 1), real_vocab=True)
        rounds = {True: [], False: []}
        for k in range(args.rounds):
            for overlap in (True, False):  # alternating, so a slow spell of the machine hits both sides
                rounds[overlap].append(one_run(shards, world, overlap, args.new_tokens, args.prompt_words))
            print(f"world {world} round {k + 1}/{args.rounds}: overlap {rounds[True][-1]}, "
                  f"no overlap {rounds[False][-1]}", flush=True)
        row = {}
        for phase in ("prefill_ms", "decode_ms"):
            on, off = min(r[phase] for r in rounds[True]), min(r[phase] for r in rounds[False])
            row[phase] = {"overlap": on, "no_overlap": off, "ratio_no_overlap_over_overlap": off / on}
        results["worlds"][world] = row
    print(f"\n{args.family}, bfloat16, {args.rounds} rounds each, fastest round (ratio > 1: overlap is faster)")
    print(f"{'world':>5}  {'prefill ms on / off':>22}  {'ratio':>6}  {'decode ms on / off':>22}  {'ratio':>6}")
    for world, row in results["worlds"].items():
        p, d = row["prefill_ms"], row["decode_ms"]
        print(f"{world:>5}  {p['overlap']:>10.1f} / {p['no_overlap']:<9.1f}  {p['ratio_no_overlap_over_overlap']:>6.3f}"
              f"  {d['overlap']:>10.1f} / {d['no_overlap']:<9.1f}  {d['ratio_no_overlap_over_overlap']:>6.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
