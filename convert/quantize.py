"""`dsconv quantize`: a checkpoint as downloaded -> W8A8 INT8 safetensors, resumable and crash-safe.

OUT is a resumable job directory (convert.outdir). Side files (index, config, description) are written
last, so an interrupted OUT never looks complete.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dsconv.convert import outdir
from dsconv.errors import InputError
from dsconv.convert.execute import part_is_complete, write_part
from dsconv.convert.formats import (ASCEND, ASCEND_FLOAT, ASCEND_INT8, DESCRIPTION_NAME, ascend_description,
                             format_for, is_side_file, output_config)
from dsconv.convert.plan import TO_INT8, Plan, make_plan
from dsconv.family.arch import recipe_for
from dsconv.convert.safetensors_io import write_bytes_atomic, write_json_atomic
from dsconv.convert.source import open_checkpoint


def build_plan(src: Path, recipe: str | None, fmt: str, max_file_bytes: int) -> Plan:
    checkpoint = open_checkpoint(src)
    if any(w.encoding == "w8a8" for w in checkpoint.weights):
        raise InputError(f"{src} is already W8A8 (INT8 weights with weight_scale); shard it with `dsconv shard`")
    return make_plan(checkpoint, recipe_for(recipe, checkpoint.family), format_for(fmt), max_file_bytes)


@dataclass(frozen=True)
class Result:
    plan: Plan
    out: Path
    bytes_in: int
    bytes_out: int
    int8_bytes: int
    seconds: float
    resumed_parts: int


def _job(plan: Plan, src: Path) -> dict:
    return {"command": "dsconv quantize", "source": str(src.resolve()), "recipe": plan.recipe.name,
            "format": plan.fmt.name, "plan_digest": plan.digest()}


def _write_side_files(plan: Plan, out: Path) -> None:
    checkpoint, fmt = plan.checkpoint, plan.fmt
    weight_map = {t.name: part.name for part in plan.parts for t in part.tensors}
    total = sum(t.nbytes for part in plan.parts for t in part.tensors)
    write_json_atomic(out / fmt.index_name, {"metadata": {"total_size": total}, "weight_map": weight_map})
    # Float linears (kept out of INT8) are what compressed-tensors' `ignore` lists, by module name.
    ignore = [item.weight.spec.name.removesuffix(".weight") for item in plan.items
              if item.action != TO_INT8 and item.weight.spec.is_linear]
    write_json_atomic(out / "config.json", output_config(checkpoint.hub_config, fmt, ignore))
    if fmt is ASCEND:
        types = {t.name: (ASCEND_INT8 if item.action == TO_INT8 else ASCEND_FLOAT)
                 for item in plan.items for t in item.outputs}
        write_json_atomic(out / DESCRIPTION_NAME, ascend_description(types))
    for path in sorted(checkpoint.root.iterdir()):
        if path.is_file() and is_side_file(path.name):
            write_bytes_atomic(out / path.name, path.read_bytes())


def side_files(plan: Plan) -> list[str]:
    return sorted(p.name for p in plan.checkpoint.root.iterdir() if p.is_file() and is_side_file(p.name))


def run_quantize(plan: Plan, out: Path, workers: int, on_progress: Callable[[int], None]) -> Result:
    """Writes the plan to OUT: new, empty, or an unfinished (or finished) run of this same job, which resumes."""
    started = time.perf_counter()
    job = _job(plan, plan.checkpoint.root)
    outdir.prepare_out(out, plan.checkpoint.root, job)
    resumed = 0
    for part in plan.parts:
        path = out / part.name
        if part_is_complete(part, path):
            resumed += 1
            on_progress(sum(item.source_bytes for item in part.items))
            continue
        write_part(part, path, plan.checkpoint.block, workers, on_progress)
    _write_side_files(plan, out)
    outdir.mark_complete(out, job)
    int8_bytes = sum(t.nbytes for item in plan.items if item.action == TO_INT8 for t in item.outputs[:1])
    return Result(plan, out, plan.checkpoint.nbytes, sum(p.nbytes for p in plan.parts), int8_bytes,
                  time.perf_counter() - started, resumed)


