"""`dsconv shard`: a checkpoint -> what each rank maps at start-up, by the placement table.

The input is our W8A8 output (INT8 weights with per-channel scales, sliced as they are) or a BF16/FP8/FP4
source (decoded to BF16, so the runner can run a BF16 baseline). Shards are grouped in directories by the
group index that reads them (`common/`, `ep-XXXXX/`, `tp-XXXXX/`, `attn-tp-XXXXX/`), written with the same
crash-safe, resumable machinery as `quantize`, and described by `manifest.json`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dsconv.convert import outdir
from dsconv.family.arch import Encoding, Family, TensorSpec
from dsconv.errors import InputError
from dsconv.convert.execute import part_is_complete, write_part
from dsconv.convert.formats import DESCRIPTION_NAME, is_side_file
from dsconv.convert.plan import DECODED, KEEP, PART_METADATA, TO_BF16, Item, Part, job_digest, output_tensors, pack
from dsconv.convert.safetensors_io import OutTensor, file_size, write_bytes_atomic, write_json_atomic
from dsconv.convert.source import Checkpoint, SourceWeight, open_checkpoint
from dsconv.family.expert_map import ExpertMap, ModelKey, read_loads, read_placement
from dsconv.family.layout import Layout
from dsconv.family.placement import Placement, check_layout, place, place_companion, sliced_shape, stack_of

W8A8, BF16 = "w8a8", "bf16"


@dataclass(frozen=True)
class ShardTensor:
    item: Item  # one output tensor: item.outputs[0]
    placement: Placement
    source: TensorSpec  # the whole tensor this is (a slice of)
    scale: str | None = None  # the per-channel scale of an INT8 weight, in the same shard set
    companion_of: str | None = None  # for a scale: its weight


@dataclass(frozen=True)
class ShardFile:
    part: Part  # part.name is the path relative to OUT
    tensors: tuple[ShardTensor, ...]


@dataclass(frozen=True)
class ExpertRequest:
    """Where `dsconv shard` puts the routed experts (family/expert_map.py): `redundant` extra physical experts
    (None: as many as the placement file has, else 0), placed by a recorded `load`, or as a `placement` file says,
    or round-robin; `nodes`: the nodes the EP ranks span, for the hierarchical policy."""
    redundant: int | None = None
    load: Path | None = None
    placement: Path | None = None
    nodes: int = 1

    def expert_map(self, checkpoint: Checkpoint, layout: Layout) -> ExpertMap | None:
        """The map for these shards; None for the placement table's blocks (nothing asked)."""
        if not self.redundant and self.load is None and self.placement is None:
            return None
        if self.load is not None and self.placement is not None:
            raise InputError("--expert-load and --expert-placement both place the experts: give one")
        arch = checkpoint.arch
        key = ModelKey.of(checkpoint.family.name, arch.n_routed_experts, (w.spec.name for w in checkpoint.weights))
        if self.placement is not None:
            experts_map = read_placement(self.placement, key, layout.ep)
            if self.redundant is not None and self.redundant != experts_map.redundant:
                raise InputError(f"{self.placement} places {experts_map.redundant} redundant experts, not "
                                 f"--num-redundant-experts {self.redundant}")
            return experts_map
        redundant = self.redundant or 0
        if self.load is None:
            return ExpertMap.round_robin(list(key.layers), key.experts, redundant, layout.ep, self.nodes)
        groups = getattr(arch, "n_group", None) or 1  # V3's expert groups; V4 routes without groups
        return ExpertMap.from_loads(read_loads(self.load, key), key.experts, redundant, layout.ep, groups,
                                    self.nodes)


@dataclass(frozen=True)
class ShardPlan:
    checkpoint: Checkpoint
    layout: Layout
    precision: str  # W8A8 when the input holds INT8 weights, else BF16
    files: tuple[ShardFile, ...]
    experts: ExpertMap | None = None  # where the routed experts' replicas are; None: the placement table's blocks

    @property
    def config(self) -> dict:
        """config.json for the shards: BF16 shards decoded from an FP8 source no longer match its FP8
        quantization_config, so it goes; a W8A8 input's config already describes its INT8 weights."""
        config = self.checkpoint.hub_config
        return {k: v for k, v in config.items() if k != "quantization_config"} if self.precision == BF16 else config

    @property
    def nbytes(self) -> int:
        """Source bytes the shards consume (all-zero weight_offsets, checked and dropped, not included)."""
        return sum(item.source_bytes for f in self.files for item in f.part.items)

    def job(self) -> dict:
        """Identifies the run for resume: changes whenever any output byte or the manifest could."""
        return {"command": "dsconv shard", "source": str(self.checkpoint.root.resolve()),
                "plan_digest": job_digest(self.checkpoint.files,
                                          [self.layout.to_json()] + ([self.experts.to_json()] if self.experts else []),
                                          (f.part for f in self.files))}


def _companion(weight: SourceWeight) -> SourceWeight:
    spec = weight.spec
    name = weight.scale.entry.name
    companion = TensorSpec(name, tuple(weight.scale.entry.shape), spec.role, Encoding.F32, spec.layer, spec.expert,
                           spec.mtp)
    return SourceWeight(companion, weight.scale, None, "float")


def _check_symmetric(weight: SourceWeight) -> None:
    if weight.offset is not None and bool(weight.offset.read().any()):
        raise InputError(f"{weight.offset.entry.name} is not all zeros: asymmetric INT8 is not supported")


def _shard_tensors(checkpoint: Checkpoint, layout: Layout, experts: ExpertMap | None) -> list[ShardTensor]:
    family, arch = checkpoint.family, checkpoint.arch
    shards: list[ShardTensor] = []
    seen: set[tuple[str, str]] = set()  # (directory, name): a replicated companion is listed once
    for weight in checkpoint.weights:
        if weight.encoding == "w8a8":
            _check_symmetric(weight)
        main = dataclasses.replace(weight, scale=None, offset=None) if weight.encoding == "w8a8" else weight
        action = TO_BF16 if weight.encoding in DECODED else KEEP
        # an INT8 weight is kept as stored, alone: its scale becomes a tensor of its own below
        (whole,) = output_tensors(weight.spec, weight.encoding, weight.value.entry.dtype)
        for placement in place(weight.spec, family, arch, layout, experts):
            out = OutTensor(whole.name, whole.dtype, sliced_shape(whole.shape, placement.split))
            scale = _companion(weight) if weight.encoding == "w8a8" else None
            shards.append(ShardTensor(Item(main, action, (out,), placement.split), placement, weight.spec,
                                      scale=scale.spec.name if scale else None))
            if scale is None:
                continue
            at = place_companion(placement, layout)
            if (at.directory, scale.spec.name) in seen:
                continue
            seen.add((at.directory, scale.spec.name))
            scale_out = OutTensor(scale.spec.name, scale.value.entry.dtype, sliced_shape(scale.spec.shape, at.split))
            shards.append(ShardTensor(Item(scale, KEEP, (scale_out,), at.split), at, scale.spec,
                                      companion_of=weight.spec.name))
    return shards


def _stacks(shards: list[ShardTensor], family: Family) -> list[list[ShardTensor]]:
    """One directory's tensors in stacks (family.placement.stack_of; an INT8 stack's scales are a stack of their
    own), each at its first member's place and in position order; every other tensor a stack of one. A stack is
    packed into one file, where Part.tensors keeps it back to back (its members share a dtype)."""
    stacks: dict[tuple, list[ShardTensor]] = {}
    for shard in shards:
        stack = stack_of(shard.source, family)
        key = ("alone", shard.item.outputs[0].name) if stack is None else (*stack[0], shard.companion_of is not None)
        stacks.setdefault(key, []).append(shard)
    return [sorted(members, key=lambda shard: stack_of(shard.source, family)[1]) if len(members) > 1 else members
            for members in stacks.values()]


def _pack(directory: str, shards: list[ShardTensor], max_file_bytes: int, family: Family) -> list[ShardFile]:
    groups = pack(_stacks(shards, family), lambda stack: [t for shard in stack for t in shard.item.outputs],
                  max_file_bytes)
    n = len(groups)
    return [ShardFile(Part(f"{directory}/part-{i + 1:05d}-of-{n:05d}.safetensors",
                           tuple(shard.item for stack in g for shard in stack)),
                      tuple(shard for stack in g for shard in stack))
            for i, g in enumerate(groups)]


def make_shard_plan(src: Path, layout: Layout, max_file_bytes: int,
                    experts: ExpertRequest = ExpertRequest()) -> ShardPlan:
    checkpoint = open_checkpoint(src)
    experts_map = experts.expert_map(checkpoint, layout)
    check_layout(checkpoint.family, checkpoint.arch, layout, experts_map.redundant if experts_map else 0)
    by_directory: dict[str, list[ShardTensor]] = {}
    for shard in _shard_tensors(checkpoint, layout, experts_map):
        by_directory.setdefault(shard.placement.directory, []).append(shard)
    files = [f for directory in sorted(by_directory)
             for f in _pack(directory, by_directory[directory], max_file_bytes, checkpoint.family)]
    precision = W8A8 if any(w.encoding == "w8a8" for w in checkpoint.weights) else BF16
    return ShardPlan(checkpoint, layout, precision, tuple(files), experts_map)


@dataclass(frozen=True)
class ShardResult:
    plan: ShardPlan
    out: Path
    bytes_out: int
    seconds: float
    resumed_files: int


def run_shard(plan: ShardPlan, out: Path, workers: int, on_progress: Callable[[int], None]) -> ShardResult:
    """Writes the shards and manifest.json to OUT: new, empty, or an unfinished run of this same job (resumed)."""
    from dsconv.manifest.schema import MANIFEST_NAME, build_manifest, write_manifest

    started = time.perf_counter()
    job = plan.job()
    outdir.prepare_out(out, plan.checkpoint.root, job)
    resumed = 0
    for shard_file in plan.files:
        path = out / shard_file.part.name
        path.parent.mkdir(parents=True, exist_ok=True)
        if part_is_complete(shard_file.part, path):
            resumed += 1
            on_progress(sum(item.source_bytes for item in shard_file.part.items))
            continue
        write_part(shard_file.part, path, plan.checkpoint.block, workers, on_progress)
    for source in sorted(plan.checkpoint.root.iterdir()):
        # config and tokenizer once at the top; the quantized checkpoint's own description does not apply
        if source.is_file() and source.name != DESCRIPTION_NAME and is_side_file(source.name):
            write_bytes_atomic(out / source.name, source.read_bytes())
    write_json_atomic(out / "config.json", plan.config)
    write_manifest(out / MANIFEST_NAME, build_manifest(plan, out))
    outdir.mark_complete(out, job)
    return ShardResult(plan, out, sum(file_size(f.part.tensors, PART_METADATA) for f in plan.files),
                       time.perf_counter() - started, resumed)
