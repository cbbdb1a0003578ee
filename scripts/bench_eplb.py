"""The MoE part of a world-16 step with expert-parallel load balancing and without it, in one run, on CPU ranks over
gloo, on the skewed routing workload: every router sends every token to EP rank 0's experts.

    python scripts/bench_eplb.py [--family deepseek_v32|deepseek_v4] [--rounds 3] [--new-tokens 8]
                                 [--hidden 1024] [--moe-intermediate 1024] [--redundant 16] [--work DIR] [--json FILE]

The family's tiny checkpoint at a larger hidden and expert size (so the experts' matmuls are a real part of the
step), its routers' selection bias forcing every token onto EP rank 0's experts (tests/test_skewed_routing.py's
workload), quantized to W8A8 and sharded for DP16 x EP16 twice:
- A, without EPLB: the placement table's blocks, rank 0 holding every expert the tokens pick;
- B, with EPLB: --redundant redundant experts placed by the load A recorded (`--expert-load-record`, then `dsconv
  shard --num-redundant-experts R --expert-load FILE`), run with its static placement (one run with `--enable-eplb`
  first, for the balancedness B's ranks reach; the timed runs do not count the load).
Then 16 prompts (one per attention-DP rank) generate on A and B alternately, --rounds times each. Each rank times
its MoE layers (dispatch, experts, combine, shared expert: models/moe.expert_parallel, wall clock); the figure is the
ranks' mean MoE seconds in the prefill step and per decode step, each side's fastest round, and the ratios A / B
(above 1: EPLB is faster). Each rank also counts the CPU seconds of its own thread in its experts' grouped kernel
(one torch thread a rank): the busiest rank's is what bounds the layer where every rank has its own compute. The
balancedness each side's ranks had comes from the same run.

On a 2-core machine the 16 ranks share 2 cores: without EPLB rank 0 computes every row on one core while the other
ranks wait; with it the rows spread over all ranks, so both cores compute. On accelerators, each with its own
compute, the busiest rank bounds the layer, and balancedness b gives the experts' part up to 1 / b.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from dsconv.comm.launch import launch
from dsconv.convert.quantize import build_plan, run_quantize
from dsconv.convert.tiny_checkpoint import EveryTokenToRankZero, make_tiny_checkpoint
from dsconv.family.layout import Layout
from dsconv.scripts.bench_serve import machine, print_machine
from dsconv.shard.shard import ExpertRequest, make_shard_plan, run_shard

WORLD = EveryTokenToRankZero.EP  # 16
LAYOUT = Layout(WORLD, WORLD, WORLD, 1)
EXPERTS = {"deepseek_v32": 64, "deepseek_v4": 32}  # rank 0 then holds as many experts as a token picks
PROMPT_TOKENS = 64  # a prefill step of 16 x 64 rows: the experts' matmuls compute-bound
TIMEOUT_S = 1800


def timed_generate(run, prompts: list[list[int]], max_new_tokens: int, out: str) -> None:
    """A rank of dsrun generate with its MoE layers timed; rank 0 writes every rank's seconds and steps to `out`."""
    from dsconv.runner.entrypoints.generate import gather_to_rank0, generate
    from dsconv.runner.models import deepseek_v3, deepseek_v4
    from dsconv.runner.models.layers import RoutedExperts

    # the prefill step's rows are the prompt's, a decode step's one; wall seconds in the MoE step, and this rank's
    # CPU seconds in its experts' grouped kernel (one torch thread a rank: the kernel runs on the calling thread)
    spent = {"prefill": 0.0, "decode": 0.0, "experts_cpu_prefill": 0.0, "experts_cpu_decode": 0.0}
    phase = ["prefill"]
    original, kernel = deepseek_v3.expert_parallel, RoutedExperts.__call__

    def timed(x, *args, **kwargs):
        phase[0] = "prefill" if x.shape[0] > 1 else "decode"
        started = time.perf_counter()
        result = original(x, *args, **kwargs)
        spent[phase[0]] += time.perf_counter() - started
        return result

    def timed_kernel(self, *args, **kwargs):
        started = time.thread_time()
        result = kernel(self, *args, **kwargs)
        spent[f"experts_cpu_{phase[0]}"] += time.thread_time() - started
        return result

    deepseek_v3.expert_parallel = deepseek_v4.expert_parallel = timed
    RoutedExperts.__call__ = timed_kernel
    result = generate(run, prompts, max_new_tokens)
    ranks = gather_to_rank0(spent)
    if result is not None:
        Path(out).write_text(json.dumps({"moe_s": ranks, "steps": result.ranks[0]["steps"],
                                         "generated": result.generated, "eplb": result.eplb}))


def one_run(shards: Path, prompts: list[list[int]], new_tokens: int, work: Path, record: Path | None = None,
            eplb: bool = False) -> dict:
    from dsconv.runner.engine.config import CacheConfig, RunConfig, SchedulerConfig
    from dsconv.runner.models.eplb import EplbConfig

    # EPLB counting, its one rebalance at the last step measuring the shards' placement (the load is the same: it
    # moves nothing)
    config = EplbConfig(window_size=new_tokens, step_interval=new_tokens) if eplb else None
    run = RunConfig.open(shards, dtype="bfloat16", cache=CacheConfig(WORLD * 64),
                         scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=PROMPT_TOKENS * WORLD),
                         expert_load_record=record, eplb=config)
    out = work / "result.json"
    code = launch(timed_generate, {"run": run, "prompts": prompts, "max_new_tokens": new_tokens, "out": str(out)},
                  world_size=WORLD, device="cpu", timeout_s=TIMEOUT_S)
    if code:
        raise SystemExit(f"the generate ranks failed ({code})")
    return json.loads(out.read_text())


def balancedness_of(record: Path) -> float:
    """The ranks' balancedness under the placement table's blocks, from a load record."""
    from dsconv.runner.models.eplb import overall

    loads = [layer for layer in json.loads(record.read_text())["loads"].values() if sum(layer)]
    return overall([[sum(layer[k * len(layer) // WORLD:(k + 1) * len(layer) // WORLD]) for k in range(WORLD)]
                    for layer in loads])


def build(work: Path, family: str, hidden: int, inter: int) -> Path:
    src, quantized = work / "src", work / "w8a8"
    overrides = {"n_routed_experts": EXPERTS[family], "hidden_size": hidden, "moe_intermediate_size": inter}
    make_tiny_checkpoint(src, family, config_overrides=overrides, maker=EveryTokenToRankZero)
    run_quantize(build_plan(src, None, "ascend", 4 * 10**9), quantized, workers=2, on_progress=lambda n: None)
    return quantized


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="deepseek_v32", choices=sorted(EXPERTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--moe-intermediate", type=int, default=1024)
    parser.add_argument("--redundant", type=int, default=16)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args()


def _print(figures: dict, args: argparse.Namespace) -> None:
    print(f"{args.family} at world {WORLD}, hidden {args.hidden}, expert intermediate {args.moe_intermediate}, "
          f"{EXPERTS[args.family]} experts (+{args.redundant} redundant with EPLB), 16 prompts, "
          f"{args.new_tokens} new tokens, fastest of {args.rounds} rounds:")
    print(f"  balancedness without EPLB {figures['balancedness_without']:.3f}, with "
          f"{figures['balancedness_with']:.3f}")
    for phase, step in (("prefill", f"the prefill step ({WORLD} x {PROMPT_TOKENS} rows)"),
                        ("decode", "a decode step (16 rows)")):
        for what, label in ((phase, "MoE wall ms, mean over ranks"),
                            (f"experts_cpu_{phase}", "experts' CPU ms on the busiest rank")):
            print(f"  {label}, {step}: without {figures[f'ms_{what}_without']:.1f}, with "
                  f"{figures[f'ms_{what}_with']:.1f}; ratio {figures[f'ratio_{what}']:.2f}x")


def main() -> None:
    args = _arguments()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-eplb-"))
    info = machine(WORLD)
    print_machine(info, WORLD)
    source = build(work / args.family, args.family, args.hidden, args.moe_intermediate)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 1000, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(WORLD)]
    plain, balanced, record = work / "shards-a", work / "shards-b", work / "load.json"
    for out in (plain, balanced):
        shutil.rmtree(out, ignore_errors=True)
    run_shard(make_shard_plan(source, LAYOUT, 4 * 10**9), plain, 2, lambda n: None)
    first = one_run(plain, prompts, args.new_tokens, work, record=record)  # also the warm-up
    run_shard(make_shard_plan(source, LAYOUT, 4 * 10**9, ExpertRequest(args.redundant, load=record)), balanced, 2,
              lambda n: None)
    # the balancedness B's ranks reach, from EPLB's own count (a run apart: counting costs its own ops)
    measured = one_run(balanced, prompts, args.new_tokens, work, eplb=True)
    sides: dict[str, list[dict]] = {"without": [], "with": []}
    for _ in range(args.rounds):
        sides["without"].append(one_run(plain, prompts, args.new_tokens, work))
        sides["with"].append(one_run(balanced, prompts, args.new_tokens, work))
    if any(r["generated"] != first["generated"] for runs in (*sides.values(), [measured]) for r in runs):
        raise SystemExit("the two sides generated different tokens")
    # per step (the one prefill step; a decode step, the mean): the ranks' mean MoE wall seconds, and the busiest
    # rank's CPU seconds in its experts; each side's fastest round
    phases = ("prefill", "decode")

    def per_step(side: str, key: str, busiest: bool) -> float:
        steps = (lambda r: 1) if key.endswith("prefill") else (lambda r: r["steps"] - 1)
        pick = (lambda ranks: max(rank[key] for rank in ranks)) if busiest else \
            (lambda ranks: sum(rank[key] for rank in ranks) / WORLD)
        return min(pick(r["moe_s"]) / steps(r) for r in sides[side])

    timings = {(side, key): per_step(side, key, key.startswith("experts"))
               for side in sides for key in (*phases, *(f"experts_cpu_{phase}" for phase in phases))}
    figures = {"machine": info, "family": args.family, "world": WORLD, "hidden": args.hidden,
               "moe_intermediate": args.moe_intermediate, "experts": EXPERTS[args.family],
               "redundant": args.redundant, "new_tokens": args.new_tokens, "rounds": args.rounds,
               "balancedness_without": balancedness_of(record),
               "balancedness_with": measured["eplb"][0]["measured"],
               **{f"ms_{what}_{side}": seconds * 1e3 for (side, what), seconds in timings.items()},
               **{f"ratio_{what}": timings["without", what] / timings["with", what]
                  for what in (*phases, *(f"experts_cpu_{phase}" for phase in phases))}}
    _print(figures, args)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
