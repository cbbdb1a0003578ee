"""One rank's weights, memory-mapped from the shard set the manifest describes.

Each file is mapped once, read-only, and every tensor is a zero-copy view into it (the sharder aligns each
tensor to its element size), so start-up costs page-table entries, not copies. On an accelerator each tensor is
copied to the device as the model takes it, one at a time, straight from the map. The model pops what it
uses; `finish()` proves that nothing it needed was missing and nothing mapped for this rank was left over.
"""

from __future__ import annotations

import json
import mmap
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsconv.errors import InputError
from dsconv.convert.safetensors_io import read_header
from dsconv.manifest.schema import MANIFEST_NAME
from dsconv.family.expert_map import ExpertMap
from dsconv.manifest.verify import expert_map_of, verify


@dataclass
class RankWeights:
    rank: int
    manifest: dict
    tensors: dict[str, torch.Tensor]  # name -> this rank's tensor (its slice, when split)
    splits: dict[str, dict | None]  # name -> {dim, start, stop} of the source tensor, or None
    device: torch.device = torch.device("cpu")  # where take() delivers: a CPU tensor stays the mapped view
    experts: ExpertMap | None = None  # the manifest's expert map (family/expert_map.py); None: the table's blocks
    _maps: list[mmap.mmap] = field(default_factory=list, repr=False)
    # name -> (index into _maps, byte offset, bytes): where a mapped tensor lies, for take_stacked
    _spans: dict[str, tuple[int, int, int]] = field(default_factory=dict, repr=False)

    def take(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise InputError(f"rank {self.rank}: shard set has no tensor {name} for this rank")
        return self.tensors.pop(name).to(self.device)

    def take_stacked(self, groups: list[list[str]],
                     scale_groups: list[list[str]] | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Each group's tensors, their rows concatenated, the groups stacked -> [len(groups), rows, ...], as one view
        of the map where the sharder wrote them back to back in this order, as it writes every stack
        (family.placement.stack_of); with scale_groups, their INT8 weights' scales likewise, as a second view.
        None, and nothing taken, where they do not lie so (shards written before the sharder ordered stacks,
        tensors in different files): the caller then copies them."""
        views = [self._stack_view(groups), None if scale_groups is None else self._stack_view(scale_groups)]
        if views[0] is None or (scale_groups is not None and views[1] is None):
            return None
        for group in (*groups, *(scale_groups or [])):
            for name in group:
                del self.tensors[name]
        return tuple(None if view is None else view.to(self.device) for view in views)

    def _stack_view(self, groups: list[list[str]]) -> torch.Tensor | None:
        names = [name for group in groups for name in group]
        if any(name not in self.tensors or name not in self._spans for name in names):
            return None
        parts = [self.tensors[name] for name in names]
        spans = [self._spans[name] for name in names]
        rows = {sum(self.tensors[name].shape[0] for name in group) for group in groups}
        first = parts[0]
        if len(rows) != 1 or any(a[0] != b[0] or a[1] + a[2] != b[1] for a, b in zip(spans, spans[1:])) \
                or any(t.dtype != first.dtype or t.dim() < 1 or t.shape[1:] != first.shape[1:] for t in parts):
            return None
        with warnings.catch_warnings():  # read-only on purpose, as in load_rank
            warnings.filterwarnings("ignore", message=".*not writable.*")
            view = torch.frombuffer(self._maps[spans[0][0]], dtype=first.dtype, count=sum(t.numel() for t in parts),
                                    offset=spans[0][1])
        return view.reshape(len(groups), rows.pop(), *first.shape[1:])

    def discard(self, name: str) -> None:
        """Marks a tensor as deliberately unused (e.g. MTP layers), without copying it to the device."""
        if self.tensors.pop(name, None) is None:
            raise InputError(f"rank {self.rank}: shard set has no tensor {name} for this rank")

    def take_optional(self, name: str) -> torch.Tensor | None:
        return self.take(name) if name in self.tensors else None

    def finish(self) -> None:
        if self.tensors:
            left = sorted(self.tensors)
            raise InputError(f"rank {self.rank}: {len(left)} mapped tensors were never used, e.g. {left[0]}")


def load_manifest(shards: Path, check: bool = True) -> dict:
    shards = Path(shards)
    if not (shards / MANIFEST_NAME).is_file():
        raise InputError(f"{shards}: no {MANIFEST_NAME}; point --shards at a `dsconv shard` output")
    if check:
        problems = verify(shards)
        if problems:
            raise InputError(f"{shards} fails `dsconv verify` ({len(problems)} problems), first: {problems[0]}")
    return json.loads((shards / MANIFEST_NAME).read_text())


def load_rank(shards: Path, manifest: dict, rank: int, device: torch.device | str = "cpu") -> RankWeights:
    world = manifest["layout"]["world_size"]
    if not 0 <= rank < world:
        raise InputError(f"rank {rank} is outside the manifest's world size {world}")
    mine = [t for t in manifest["tensors"] if rank in t["ranks"]]
    weights = RankWeights(rank, manifest, {}, {}, torch.device(device), expert_map_of(manifest))
    by_file: dict[str, list[dict]] = {}
    for t in mine:
        by_file.setdefault(t["file"], []).append(t)
    for rel, entries in sorted(by_file.items()):
        path = Path(shards) / rel
        header = read_header(path)
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        weights._maps.append(mapped)
        for t in entries:
            entry = header[t["name"]]
            count = entry.nbytes // entry.dtype.itemsize
            with warnings.catch_warnings():  # the map is read-only on purpose: weights are never written
                warnings.filterwarnings("ignore", message=".*not writable.*")
                view = torch.frombuffer(mapped, dtype=entry.dtype, count=count, offset=entry.offset) \
                    if count else torch.empty(0, dtype=entry.dtype)
            weights.tensors[t["name"]] = view.reshape(entry.shape)
            weights._spans[t["name"]] = (len(weights._maps) - 1, entry.offset, entry.nbytes)
            weights.splits[t["name"]] = t["split"]
    return weights
