"""`dsconv shard` and `dsconv verify`; registered on the `dsconv` app by cli.py (the repository root's)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.markup import escape

from dsconv.console import byte_progress, console, err_console, parse_size, resolve_workers, user_errors
from dsconv.family.layout import DEFAULT_WORLD_SIZE, Layout
from dsconv.family.placement import CATEGORIES, category


def rank_table(plan) -> Table:
    """Per rank, the bytes it maps by category; ranks with identical figures share a row."""
    per_rank = {r: dict.fromkeys(CATEGORIES, 0) for r in range(plan.layout.world_size)}
    for shard_file in plan.files:
        for shard in shard_file.tensors:
            for rank in shard.placement.ranks:
                per_rank[rank][category(shard.source)] += shard.item.outputs[0].nbytes
    rows: dict[tuple, list[int]] = {}
    for rank, figures in per_rank.items():
        rows.setdefault(tuple(figures.values()), []).append(rank)
    table = Table(title=f"per-rank weights ({plan.precision}), GB")
    for column in ("ranks", *CATEGORIES, "total"):
        table.add_column(column, justify="right")
    for figures, ranks in rows.items():
        label = f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1 \
            else ",".join(map(str, ranks))
        table.add_row(label, *(f"{v / 1e9:.3f}" for v in figures), f"{sum(figures) / 1e9:.3f}")
    return table


def shard(
    src: Annotated[Path, typer.Argument(help="A dsconv W8A8 output (ascend or compressed-tensors), or a BF16/FP8 "
                                             "Hugging Face checkpoint (decoded to BF16 for a BF16 baseline).")],
    out: Annotated[Path, typer.Argument(help="Shard directory: new or empty, or an interrupted run to resume.")],
    ep: Annotated[int, typer.Option(help="MoE expert-parallel size: rank r owns experts [r*E/ep, (r+1)*E/ep).")]
        = DEFAULT_WORLD_SIZE,
    tp: Annotated[int, typer.Option(help="lm_head vocabulary-parallel size (contiguous vocab rows per rank).")]
        = DEFAULT_WORLD_SIZE,
    attn_tp: Annotated[int, typer.Option(help="Attention tensor-parallel size: 1 replicates attention "
                                              "(attention DP = world); 8 gives V3.2's DP2 x TP8.")] = 1,
    oproj_tp: Annotated[int, typer.Option(help="o_proj tensor-parallel size (vllm-ascend's "
                                               "oproj_tensor_parallel_size): o_proj's output rows split over groups "
                                               "of this many attention-DP ranks, which exchange activations instead "
                                               "of each holding the whole weight. Needs --attn-tp 1; V3 / V3.2 only."
                                               )] = 1,
    embed_tp: Annotated[int, typer.Option(help="Embedding tensor-parallel size (vllm-ascend's "
                                               "embedding_tensor_parallel_size): the embedding's vocabulary rows "
                                               "split over groups of this many ranks.")] = 1,
    world_size: Annotated[Optional[int], typer.Option(
        help="Number of ranks; every size must divide it. Default: the largest of --ep, --tp, --attn-tp, "
             "--oproj-tp and --embed-tp (16 with the defaults; 1 for --ep 1 --tp 1).")] = None,
    num_redundant_experts: Annotated[Optional[int], typer.Option(help=(
        "Redundant experts per MoE layer (vLLM's and SGLang's name): each EP rank holds (n_routed_experts + this) "
        "/ ep experts, replicas of the hottest placed by --expert-load (DeepSeek's EPLB policy), else round-robin. "
        "The sum must divide by --ep. Default: 0, or as many as --expert-placement has."))] = None,
    expert_load: Annotated[Optional[Path], typer.Option(help=(
        "A load record (`dsrun generate/serve --expert-load-record FILE`) of this model: the replicas go where "
        "the load was."))] = None,
    expert_placement: Annotated[Optional[Path], typer.Option(help=(
        "A placement of this model's experts (format dsrun-expert-placement: per layer, the logical expert of "
        "each physical slot), used as it is."))] = None,
    num_nodes: Annotated[int, typer.Option(help=(
        "Nodes the EP ranks span, for --expert-load's hierarchical policy (each node's expert groups stay on its "
        "ranks)."))] = 1,
    max_file_size: Annotated[str, typer.Option(help="Cap on each shard file.")] = "4GB",
    workers: Annotated[Optional[int], typer.Option(help="Worker threads (default: all cores).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print per-rank bytes and write nothing.")] = False,
) -> None:
    """Write per-rank shards of SRC to OUT plus OUT/manifest.json (check it with `dsconv verify`).

    Replicated tensors are written once under OUT/common/ and read by every rank; experts go to
    OUT/ep-XXXXX/, lm_head vocabulary slices to OUT/tp-XXXXX/, attention head slices to OUT/attn-tp-XXXXX/,
    o_proj row slices to OUT/oproj-tp-XXXXX/, embedding vocabulary slices to OUT/embed-tp-XXXXX/. With
    redundant experts, each replica goes to its EP rank's directory and the manifest records the map.
    """
    from dsconv.shard.shard import ExpertRequest, make_shard_plan, run_shard

    with user_errors():
        n_workers = resolve_workers(workers)
        layout = Layout.sized(world_size, ep, tp, attn_tp, oproj_tp, embed_tp)
        experts = ExpertRequest(num_redundant_experts, expert_load, expert_placement, num_nodes)
        plan = make_shard_plan(src, layout, parse_size(max_file_size), experts)
        if dry_run:
            _planned(plan, layout)
            return
        with byte_progress("shard", plan.nbytes) as update:
            result = run_shard(plan, out, n_workers, update)
    _wrote(plan, result, out, layout)


def _planned(plan, layout: Layout) -> None:
    """--dry-run's report: per-rank bytes, the files and directories, the layout."""
    console.print(rank_table(plan))
    console.print(f"{len(plan.files)} files in {len({f.part.name.split('/')[0] for f in plan.files})} "
                  f"directories; {layout_line(layout, plan.experts)}; groups {layout.to_json()['groups']}",
                  highlight=False)


def _wrote(plan, result, out: Path, layout: Layout) -> None:
    """A shard run's report: per-rank bytes, then what was written, how fast."""
    console.print(rank_table(plan))
    kept = f", {result.resumed_files} kept from an earlier run" if result.resumed_files else ""
    console.print(f"wrote {len(plan.files)} files ({result.bytes_out / 1e9:.3f} GB{kept}) and manifest.json to "
                  f"{escape(str(out))} in {result.seconds:.2f} s ({plan.nbytes / max(result.seconds, 1e-9) / 1e9:.2f} "
                  f"GB/s in); {layout_line(layout, plan.experts)}", highlight=False)


def layout_line(layout: Layout, experts=None) -> str:
    redundant = f" with {experts.redundant} redundant experts a layer" if experts and experts.redundant else ""
    return (f"world size {layout.world_size}: attention DP {layout.dp} x attention TP {layout.attn_tp}, EP "
            f"{layout.ep}{redundant}, lm_head TP {layout.tp}")


def verify(
    out: Annotated[Path, typer.Argument(help="A shard directory written by `dsconv shard`.")],
    full: Annotated[bool, typer.Option("--full", help="Also check every file's sha256 (reads everything).")] = False,
) -> None:
    """Check OUT/manifest.json against the files and against itself; exit 0 only when all is well."""
    from dsconv.manifest.verify import verify as run_verify

    with user_errors():
        problems = run_verify(out, full)
    if problems:
        for problem in problems:
            err_console.print(f"[red]problem:[/] {escape(str(problem))}", highlight=False, soft_wrap=True)
        err_console.print(f"[bold red]{len(problems)} problem(s)[/] in {escape(str(out))}", highlight=False)
        raise typer.Exit(1)
    console.print(f"[bold green]ok[/]: {escape(str(out))} matches its manifest" + (" (sha256 checked)" if full else ""),
                  highlight=False)
