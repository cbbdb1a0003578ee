"""`dsconv plan`: per-rank weight and KV-cache memory from config.json alone, before any download.

Sizes come from the tensor inventory (family.arch), the output dtypes (convert.plan.output_tensors) and the
placement table (family.placement), so they match what `dsconv shard` writes byte for byte (file headers
aside).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from dsconv.family.arch import Family, check_kv_cache_dtype, family_for, recipe_for, recipes_help
from dsconv.console import console, fail
from dsconv.errors import InputError
from dsconv.family.recipes import Recipe
from dsconv.family.layout import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_WORLD_SIZE, Layout
from dsconv.family.placement import CATEGORIES, check_layout
from dsconv.shard.sizes import (CACHE_DTYPE, entries, footprint, kv_cache_bytes, kv_cache_bytes_per_sequence,
                                kv_cache_bytes_per_token, moe_exchange_worst_case, redundant_map)

GB = 10**9  # every figure is printed in decimal GB, card capacity included
CONFIG_NAME = "config.json"


def load_config(path: Path) -> dict:
    """config.json, or the config.json inside a checkpoint directory."""
    if path.is_dir():
        path = path / CONFIG_NAME
    if not path.is_file():
        raise InputError(f"config file {path} does not exist")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"config file {path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise InputError(f"config file {path} holds a {type(config).__name__}, not a JSON object")
    return config


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> "0-3,8"."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.2f}"


def _tokens(count: int) -> str:
    return f"{count:,}" if count > 0 else "0"


def build_report(family: Family, arch: object, layout: Layout, precisions: list[tuple[str, Recipe | None]],
                 kv_cache_dtype: str, card_gb: float, batch: int, seq: int, mtp: bool,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, redundant: int = 0) -> dict:
    """Everything `dsconv plan` shows, as one JSON-able object (what --json prints). redundant: the redundant
    experts (`dsconv shard --num-redundant-experts`), counted with the experts."""
    experts = redundant_map(family, arch, layout, redundant)
    per_token = kv_cache_bytes_per_token(family, arch, kv_cache_dtype)
    per_sequence = kv_cache_bytes_per_sequence(family, arch, kv_cache_dtype)
    token_bytes, sequence_bytes = sum(per_token.values()), sum(per_sequence.values())
    kv_bytes = kv_cache_bytes(family, arch, batch, seq, kv_cache_dtype)
    card = round(card_gb * GB)
    report = {
        "model": family.name, "layout": {k: v for k, v in layout.to_json().items() if k != "groups"},
        "card_bytes": card, "batch": batch, "seq": seq, "mtp_counted": mtp, "redundant_experts": redundant,
        "kv_cache": {"dtype": kv_cache_dtype, "entry_dtype": str(CACHE_DTYPE).removeprefix("torch."),
                     "bytes_per_token": per_token, "bytes_per_token_total": token_bytes,
                     "bytes_per_sequence": per_sequence, "bytes_for_batch": kv_bytes},
        "precisions": [],
    }
    for label, chosen in precisions:
        per_rank, on_disk = footprint(entries(family, arch, chosen, mtp=mtp), family, arch, layout, experts)
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, by_category in per_rank.items():
            groups.setdefault(tuple(by_category[c] for c in CATEGORIES), []).append(rank)
        rows = []
        for figures, ranks in groups.items():
            weights = sum(figures)
            free = card - weights - batch * sequence_bytes  # what the cache's growing part may use
            rows.append({"ranks": ranks, "weights": dict(zip(CATEGORIES, figures)), "weights_total": weights,
                         "headroom": card - weights - kv_bytes,
                         "tokens_fit": max(0, int(free // token_bytes)) if token_bytes else None})
        report["precisions"].append({
            "label": label, "recipe": None if chosen is None else chosen.name, "ranks": rows,
            "on_disk_bytes": sum(sum(by_category.values()) for by_category in on_disk.values()),
            "shard_directories": len(on_disk),
            "moe_exchange_worst_case": moe_exchange_worst_case(arch, layout, max_num_batched_tokens,
                                                               w8a8=chosen is not None)})
    return report


def _weights_table(title: str, precision: dict, kv_bytes: int, card_gb: float) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("ranks", *CATEGORIES, "weights", "KV cache", f"headroom on {card_gb:g} GB", "tokens that fit"):
        table.add_column(column, justify="left" if column == "ranks" else "right")
    for row in precision["ranks"]:
        headroom = Text(_gb(row["headroom"]), style="bold red" if row["headroom"] < 0 else "green")
        table.add_row(rank_ranges(row["ranks"]), *(_gb(row["weights"][c]) for c in CATEGORIES),
                      _gb(row["weights_total"]), _gb(kv_bytes), headroom,
                      "" if row["tokens_fit"] is None else f"{row['tokens_fit']:,}")
    return table


def _kv_table(report: dict, layers: int) -> Table:
    kv, batch, seq = report["kv_cache"], report["batch"], report["seq"]
    form = (f"INT8 with float32 scales where quantized, the rest {kv['entry_dtype']}" if kv["dtype"] == "int8"
            else kv["entry_dtype"])
    table = Table(title=f"KV cache per rank, --kv-cache-dtype {kv['dtype']} ({form}; the {layers} main layers, "
                        f"MTP layers not counted)", title_justify="left")
    for column in ("component", "bytes per token", "bytes per sequence", f"GB for {batch} x {seq} tokens"):
        table.add_column(column, justify="left" if column == "component" else "right")
    for name, nbytes in kv["bytes_per_token"].items():
        table.add_row(name, f"{nbytes:,.0f}", "", _gb(batch * seq * nbytes))
    for name, nbytes in kv["bytes_per_sequence"].items():
        table.add_row(name, "", f"{nbytes:,}", _gb(batch * nbytes))
    table.add_section()
    table.add_row("total", f"{kv['bytes_per_token_total']:,.0f}", f"{sum(kv['bytes_per_sequence'].values()):,}",
                  _gb(kv["bytes_for_batch"]), style="bold")
    return table


def _precisions(family: Family, recipe: Optional[str]) -> list[tuple[str, Recipe | None]]:
    chosen = recipe_for(recipe, family)
    return [("BF16", None), (f"W8A8 (recipe {chosen.name})", chosen)]


# -- plan's options ------------------------------------------------------------------------------------------------

ConfigPath = Annotated[Path, typer.Option(
    help="The model's config.json (or a checkpoint directory holding one); nothing else is read.")]
Ep = Annotated[int, typer.Option(
    help="MoE expert-parallel size: each EP rank owns n_routed_experts/ep experts of every layer.")]
Tp = Annotated[int, typer.Option(help="lm_head vocabulary-parallel size: each rank owns vocab/tp rows.")]
AttnTp = Annotated[int, typer.Option(help=(
    "Attention tensor-parallel size (heads split over attn-tp ranks); 1 replicates attention on every rank "
    "(attention DP = world size). V3.2's usual choice is 8, V4-Flash's is 1."))]
OprojTp = Annotated[int, typer.Option(
    help="o_proj tensor-parallel size over attention-DP ranks (needs --attn-tp 1; V3 / V3.2).")]
EmbedTp = Annotated[int, typer.Option(help="Embedding vocabulary-parallel size.")]
WorldSize = Annotated[Optional[int], typer.Option(help=(
    "Number of ranks (cards). Default: the largest of --ep, --tp, --attn-tp, --oproj-tp and --embed-tp, as for "
    "`dsconv shard`."))]
CardGb = Annotated[float, typer.Option(
    help="Memory of one card in GB (10^9 bytes); headroom = card - weights - KV cache.")]
Batch = Annotated[int, typer.Option(
    help="Sequences per attention-DP rank (each DP rank holds only its own requests' KV cache).")]
Seq = Annotated[int, typer.Option(help="Tokens per sequence (prompt + generated).")]
MaxNumBatchedTokens = Annotated[int, typer.Option(help=(
    "Tokens one attention-DP rank feeds per step (dsrun's flag): sizes the worst-case MoE exchange, every token of "
    "every DP rank routed to one rank's experts."))]
KvCacheDtype = Annotated[str, typer.Option(help=(
    "KV cache entries: auto (BF16) or int8 (V3 / V3.2: the MLA latent and indexer keys in INT8 with float32 scales, "
    "the rope key BF16), as dsrun --kv-cache-dtype."))]
Mtp = Annotated[bool, typer.Option(help=(
    "Count the MTP layer's weights (the converter writes them; a runner without speculative decoding need not load "
    "them)."))]
JsonOutput = Annotated[bool, typer.Option("--json", help=(
    "Print one JSON object (per-rank weights by category, cache bytes per token by component, headroom, tokens that "
    "fit) instead of tables."))]


def plan(
    config: ConfigPath,
    ep: Ep = DEFAULT_WORLD_SIZE,
    tp: Tp = DEFAULT_WORLD_SIZE,
    attn_tp: AttnTp = 1,
    oproj_tp: OprojTp = 1,
    embed_tp: EmbedTp = 1,
    world_size: WorldSize = None,
    card_gb: CardGb = 64,
    batch: Batch = 1,
    seq: Seq = 4096,
    max_num_batched_tokens: MaxNumBatchedTokens = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    kv_cache_dtype: KvCacheDtype = "auto",
    # inline, not a module-level alias: recipes_help() lists the families registered when the command is built
    recipe: Annotated[Optional[str], typer.Option(help="Recipe of the W8A8 table. " + recipes_help())] = None,
    mtp: Mtp = True,
    num_redundant_experts: Annotated[int, typer.Option(help=(
        "Redundant experts per MoE layer (as `dsconv shard --num-redundant-experts`), counted with each rank's "
        "experts: (n_routed_experts + this) / ep slots a rank."))] = 0,
    json_output: JsonOutput = False,
) -> None:
    """Per-rank memory for a parallel layout, from config.json alone: plan before downloading 160-700 GB.

    Tables for BF16 and W8A8: each rank's weights by category, KV cache for --batch x --seq, headroom per card,
    and the tokens of KV cache per attention-DP rank that fit beside the weights (no reserve for activations or
    workspace).
    """
    try:
        raw = load_config(config)
        family = family_for(raw)
        arch = family.parse_config(raw)
        layout = Layout.sized(world_size, ep=ep, tp=tp, attn_tp=attn_tp, oproj_tp=oproj_tp, embed_tp=embed_tp)
        check_layout(family, arch, layout, num_redundant_experts)
        redundant_map(family, arch, layout, num_redundant_experts)  # refuses a count the ranks cannot share
        check_kv_cache_dtype(family, kv_cache_dtype)
        _check_positive({"--batch": batch, "--seq": seq, "--card-gb": card_gb,
                         "--max-num-batched-tokens": max_num_batched_tokens})
        precisions = _precisions(family, recipe)
    except InputError as exc:
        fail(str(exc))

    report = build_report(family, arch, layout, precisions, kv_cache_dtype, card_gb, batch, seq, mtp,
                          max_num_batched_tokens, num_redundant_experts)
    if json_output:
        print(json.dumps(report, indent=1))
        return
    _print_report(report, arch, layout, config, card_gb)


def _check_positive(values: dict[str, float]) -> None:
    """values: option name -> value; the first that is not positive is an InputError."""
    for name, value in values.items():
        if value <= 0:
            raise InputError(f"{name} {value} must be positive")


def _print_report(report: dict, arch: object, layout: Layout, config: Path, card_gb: float) -> None:
    """The tables `dsconv plan` prints without --json: a weights table per precision, then the KV cache's."""
    batch, seq, kv = report["batch"], report["seq"], report["kv_cache"]
    fine = "".join(f", {name} {size}" for name, size in (("o_proj TP", layout.oproj_tp),
                                                         ("embedding TP", layout.embed_tp)) if size > 1)
    if report["redundant_experts"]:
        fine += f", {report['redundant_experts']} redundant experts a layer"
    console.print(f"[bold]dsconv plan[/]: {report['model']} from {escape(str(config))}; {layout.world_size} ranks: "
                  f"attention DP {layout.dp} x TP {layout.attn_tp}, MoE EP {layout.ep}, lm_head TP {layout.tp}{fine}")
    mtp_note = "MTP layer included" if report["mtp_counted"] else "MTP layer not counted"
    for precision in report["precisions"]:
        title = (f"{precision['label']} weights, GB (10^9 B) per rank ({mtp_note}); KV cache "
                 f"({kv['dtype']}) for {batch} x {seq} tokens; tokens of KV cache that fit beside the weights")
        console.print(_weights_table(title, precision, kv["bytes_for_batch"], card_gb))
        console.print(f"  on disk: {_gb(precision['on_disk_bytes'])} GB in {precision['shard_directories']} shard "
                      f"directories (replicated tensors counted once; file headers and Ascend weight_offset zeros "
                      f"excluded)")
        worst = precision["moe_exchange_worst_case"]
        parts = ", ".join(f"{name} {_gb(nbytes)}" for name, nbytes in worst["bytes"].items())
        console.print(f"  worst-case MoE exchange on one rank, per layer: {worst['rows']:,} rows ({layout.dp} DP "
                      f"ranks x {worst['tokens_per_dp_rank']:,} tokens x the picks one rank can own) = "
                      f"{_gb(worst['bytes_total'])} GB ({parts}); balanced routing receives about 1/{layout.ep} of it")
    console.print(_kv_table(report, arch.num_hidden_layers))
    console.print(f"  --batch {batch} is per attention-DP rank: {layout.dp} DP ranks hold up to {batch * layout.dp} "
                  f"sequences in all. Tokens that fit: (card - weights - {batch} x bytes per sequence) / bytes per "
                  f"token, per attention-DP rank, with no reserve for activations or workspace.")
    if layout.attn_tp > 1:
        console.print(f"  Attention TP does not split this cache (one latent or one KV head serves all heads): "
                      f"each of a DP group's {layout.attn_tp} ranks holds it whole.")
