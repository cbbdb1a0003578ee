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

from dsconv.family.arch import Family, family_for
from dsconv.console import console, fail
from dsconv.errors import InputError
from dsconv.family.recipes import Recipe, recipe_for, recipes_help
from dsconv.family.layout import DEFAULT_WORLD_SIZE, Layout
from dsconv.family.placement import CATEGORIES, check_layout
from dsconv.shard.sizes import (CACHE_DTYPE, entries, footprint, kv_cache_bytes, kv_cache_bytes_per_sequence,
                         kv_cache_bytes_per_token)

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


def _weights_table(title: str, per_rank: dict[int, dict[str, int]], kv_bytes: int, card_gb: float) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("ranks", *CATEGORIES, "weights", "KV cache", f"headroom on {card_gb:g} GB"):
        table.add_column(column, justify="left" if column == "ranks" else "right")
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, by_category in per_rank.items():
        groups.setdefault(tuple(by_category[c] for c in CATEGORIES), []).append(rank)
    for figures, ranks in groups.items():
        weights = sum(figures)
        headroom = card_gb * GB - weights - kv_bytes
        table.add_row(rank_ranges(ranks), *map(_gb, figures), _gb(weights), _gb(kv_bytes),
                      Text(_gb(headroom), style="bold red" if headroom < 0 else "green"))
    return table


def _kv_table(family: Family, arch: object, batch: int, seq: int) -> Table:
    per_token = kv_cache_bytes_per_token(family, arch)
    per_sequence = kv_cache_bytes_per_sequence(family, arch)
    table = Table(title=f"KV cache per rank ({str(CACHE_DTYPE).removeprefix('torch.')}; the "
                        f"{arch.num_hidden_layers} main layers, MTP layers not counted)", title_justify="left")
    for column in ("component", "bytes per token", "bytes per sequence", f"GB for {batch} x {seq} tokens"):
        table.add_column(column, justify="left" if column == "component" else "right")
    for name, nbytes in per_token.items():
        table.add_row(name, f"{nbytes:,.0f}", "", _gb(batch * seq * nbytes))
    for name, nbytes in per_sequence.items():
        table.add_row(name, "", f"{nbytes:,}", _gb(batch * nbytes))
    table.add_section()
    table.add_row("total", f"{sum(per_token.values()):,.0f}", f"{sum(per_sequence.values()):,}",
                  _gb(kv_cache_bytes(family, arch, batch, seq)), style="bold")
    return table


def _precisions(family: Family, recipe: Optional[str]) -> list[tuple[str, Recipe | None]]:
    chosen = recipe_for(recipe, family)
    return [("BF16", None), (f"W8A8 (recipe {chosen.name})", chosen)]


def plan(
    config: Annotated[Path, typer.Option(
        help="The model's config.json (or a checkpoint directory holding one); nothing else is read.")],
    ep: Annotated[int, typer.Option(help="MoE expert-parallel size: each EP rank owns n_routed_experts/ep "
                                         "experts of every layer.")] = DEFAULT_WORLD_SIZE,
    tp: Annotated[int, typer.Option(help="lm_head vocabulary-parallel size: each rank owns vocab/tp rows.")]
    = DEFAULT_WORLD_SIZE,
    attn_tp: Annotated[int, typer.Option(help="Attention tensor-parallel size (heads split over attn-tp ranks); "
                                              "1 replicates attention on every rank (attention DP = world "
                                              "size). V3.2's usual choice is 8, V4-Flash's is 1.")] = 1,
    world_size: Annotated[int, typer.Option(help="Number of ranks (cards).")] = DEFAULT_WORLD_SIZE,
    card_gb: Annotated[float, typer.Option(help="Memory of one card in GB (10^9 bytes); headroom = card - "
                                                "weights - KV cache.")] = 64,
    batch: Annotated[int, typer.Option(help="Sequences per attention-DP rank (each DP rank holds only its own "
                                            "requests' KV cache).")] = 1,
    seq: Annotated[int, typer.Option(help="Tokens per sequence (prompt + generated).")] = 4096,
    recipe: Annotated[Optional[str], typer.Option(
        help="Recipe of the W8A8 table. " + recipes_help())] = None,
    mtp: Annotated[bool, typer.Option(help="Count the MTP layer's weights (the converter writes them; a runner "
                                           "without speculative decoding need not load them).")] = True,
) -> None:
    """Per-rank memory for a parallel layout, from config.json alone: plan before downloading 160-700 GB.

    Tables for BF16 and W8A8: each rank's weights by category, KV cache for --batch x --seq, headroom per card.
    """
    try:
        raw = load_config(config)
        family = family_for(raw)
        arch = family.parse_config(raw)
        layout = Layout(world_size=world_size, ep=ep, tp=tp, attn_tp=attn_tp)
        check_layout(family, arch, layout)
        for name, value in (("--batch", batch), ("--seq", seq), ("--card-gb", card_gb)):
            if value <= 0:
                raise InputError(f"{name} {value} must be positive")
        precisions = _precisions(family, recipe)
    except InputError as exc:
        fail(str(exc))

    kv_bytes = kv_cache_bytes(family, arch, batch, seq)
    console.print(f"[bold]dsconv plan[/]: {family.name} from {escape(str(config))}; {layout.world_size} ranks: "
                  f"attention DP {layout.dp} x TP {layout.attn_tp}, MoE EP {layout.ep}, lm_head TP {layout.tp}")
    mtp_note = "MTP layer included" if mtp else "MTP layer not counted"
    for label, chosen in precisions:
        per_rank, on_disk = footprint(entries(family, arch, chosen, mtp=mtp), family, arch, layout)
        title = f"{label} weights, GB (10^9 B) per rank ({mtp_note}); KV cache for {batch} x {seq} tokens"
        console.print(_weights_table(title, per_rank, kv_bytes, card_gb))
        disk = sum(sum(by_category.values()) for by_category in on_disk.values())
        console.print(f"  on disk: {_gb(disk)} GB in {len(on_disk)} shard directories (replicated tensors counted "
                      f"once; file headers and Ascend weight_offset zeros excluded)")
    console.print(_kv_table(family, arch, batch, seq))
    console.print(f"  --batch {batch} is per attention-DP rank: {layout.dp} DP ranks hold up to {batch * layout.dp} "
                  f"sequences in all.")
    if layout.attn_tp > 1:
        console.print(f"  Attention TP does not split this cache (one latent or one KV head serves all heads): "
                      f"each of a DP group's {layout.attn_tp} ranks holds it whole.")
