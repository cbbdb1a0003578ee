"""`dsconv quantize`: the converter's command (the `dsconv` app is assembled in cli.py). The function
signature is the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from dsconv.console import byte_progress, console, err_console, parse_size, resolve_workers, user_errors
from dsconv.errors import InputError
from dsconv.convert.formats import FORMATS
from dsconv.family.arch import recipes_help

def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB"


def _print_plan(plan) -> None:
    from dsconv.convert.quantize import side_files

    table = Table(title=f"dsconv quantize plan: {plan.checkpoint.family.name}, recipe {plan.recipe.name}, "
                        f"format {plan.fmt.name}")
    for column in ("tensor", "source", "shape", "output", "file"):
        table.add_column(column, overflow="fold")
    for part in plan.parts:
        for item in part.items:
            w = item.weight
            source = str(w.value.entry.dtype).removeprefix("torch.")
            if w.scale is not None:
                source += f" + {str(w.scale.entry.dtype).removeprefix('torch.')} scale ({w.encoding})"
            output = " + ".join(f"{t.name.rsplit('.', 1)[-1]} {str(t.dtype).removeprefix('torch.')}"
                                for t in item.outputs)
            table.add_row(w.spec.name, source, "x".join(map(str, w.spec.shape)), output, part.name)
    console.print(table)
    int8 = sum(1 for item in plan.items if item.action == "int8")
    console.print(f"{len(plan.items)} tensors -> {len(plan.parts)} file(s), {int8} INT8 linears, "
                  f"{_gb(plan.checkpoint.nbytes)} in -> {_gb(sum(p.nbytes for p in plan.parts))} out; "
                  f"side files copied: {', '.join(side_files(plan)) or 'none'}")


def quantize(
    src: Annotated[Optional[Path], typer.Argument(
        help="Hugging Face checkpoint directory (config.json + *.safetensors). Omit both SRC and OUT to run "
             "the built-in demo: a tiny DeepSeek-V4 checkpoint with random weights.")] = None,
    out: Annotated[Optional[Path], typer.Argument(
        help="Output directory: new or empty, or an interrupted run to resume.")] = None,
    recipe: Annotated[Optional[str], typer.Option(help="Which linears become INT8. " + recipes_help())] = None,
    format: Annotated[str, typer.Option("--format", help="Output layout: " + "; ".join(
        f"{f.name}: {f.help}" for f in FORMATS.values()))] = "ascend",
    max_file_size: Annotated[str, typer.Option(help="Cap on each output weight file.")] = "4GB",
    workers: Annotated[Optional[int], typer.Option(help="Worker threads (default: all cores).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the per-tensor plan and write nothing.")] = False,
) -> None:
    """Quantize SRC (BF16, FP8 block-scaled, or V4 FP8 + FP4 experts) to W8A8 INT8 in OUT.

    Weights listed by the recipe become symmetric per-output-channel INT8 (scale = amax/127); every
    other FP8/FP4 tensor is decoded to BF16, and float tensors are kept as shipped. Streams tensor by
    tensor; re-running the same command after an interruption resumes it.
    """
    from dsconv.convert.quantize import build_plan, run_quantize

    with user_errors():
        if src is None:
            from dsconv.convert.demo import demo_output, demo_source

            err_console.print("[yellow]No SRC given: running the built-in demo, a tiny DeepSeek-V4 checkpoint in "
                              "the real hub format (FP8 + FP4 experts) with RANDOM weights.[/]")
            src, out = demo_source(), demo_output(format)
        elif out is None:
            raise InputError("OUT is required when SRC is given")
        n_workers = resolve_workers(workers)
        plan = build_plan(src, recipe, format, parse_size(max_file_size))
        if dry_run:
            _print_plan(plan)
            return
        with byte_progress("quantize", plan.source_bytes) as update:
            result = run_quantize(plan, out, n_workers, update)
    _print_summary(result)


def _print_summary(result) -> None:
    plan = result.plan
    table = Table(title=f"dsconv quantize: {result.out}", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    n_out = sum(len(item.outputs) for item in plan.items)
    int8 = sum(1 for item in plan.items if item.action == "int8")
    table.add_row("model", f"{plan.checkpoint.family.name}, recipe {plan.recipe.name}, format {plan.fmt.name}")
    table.add_row("tensors", f"{len(plan.items)} in -> {n_out} out ({int8} INT8 linears)")
    mtp = len({w.spec.layer for w in plan.checkpoint.weights if w.spec.mtp})
    table.add_row("MTP layers", f"{mtp}" if mtp else "none: no MTP tensors")
    table.add_row("bytes", f"{_gb(result.bytes_in)} in -> {_gb(result.bytes_out)} out")
    table.add_row("INT8 share of output", f"{result.int8_bytes / max(result.bytes_out, 1):.1%}")
    table.add_row("files", f"{len(plan.parts)} weight files" + (f" ({result.resumed_parts} kept from an earlier run)"
                                                               if result.resumed_parts else ""))
    table.add_row("time", f"{result.seconds:.2f} s, {result.bytes_in / max(result.seconds, 1e-9) / 1e9:.2f} GB/s in")
    console.print(table)
