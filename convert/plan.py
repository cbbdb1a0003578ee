"""The conversion plan: every output tensor, its dtype and shape, and the file it lands in, before any work.

Because the plan fixes each file's exact header, workers can write results straight to their offsets,
a resumed run can tell a finished file from a stale one, and `--dry-run` shows what would happen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from dsconv.family.arch import Encoding, TensorSpec
from dsconv.convert.formats import IntTensor, OutputFormat
from dsconv.family.recipes import Recipe
from dsconv.convert.safetensors_io import OutTensor, file_size
from dsconv.convert.source import Checkpoint, SourceWeight

KEEP, TO_BF16, TO_INT8 = "keep", "bf16", "int8"
PART_METADATA = {"format": "pt"}  # transformers refuses safetensors files without it
DECODED = (Encoding.FP8, Encoding.FP4)  # block-scaled encodings, written as BF16 when kept float
# The dtype each hub encoding is stored in (FP8 and FP4: the payload next to its scale; FP4 packs two per int8)
STORED_DTYPES = {Encoding.BF16: torch.bfloat16, Encoding.F32: torch.float32, Encoding.I32: torch.int32,
                 Encoding.I64: torch.int64, Encoding.FP8: torch.float8_e4m3fn, Encoding.FP4: torch.int8}


def output_tensors(spec: TensorSpec, encoding: str, stored: torch.dtype,
                   int8_tensors: tuple[IntTensor, ...] = ()) -> tuple[OutTensor, ...]:
    """What one source tensor becomes, for `dsconv quantize` and for the sizes `dsconv plan` sums.

    With `int8_tensors` (the recipe quantizes it; a format's INT8 layout), the INT8 weight and its per-channel
    companions [out, 1]; otherwise the tensor itself: FP8/FP4 (`encoding`) decoded to BF16, anything else in the
    dtype it is stored in.
    """
    if int8_tensors:
        base = spec.name.removesuffix("weight")
        rows = spec.shape[0]
        return tuple(OutTensor(base + t.suffix, t.dtype, (rows, 1) if t.per_channel else spec.shape)
                     for t in int8_tensors)
    return (OutTensor(spec.name, torch.bfloat16 if encoding in DECODED else stored, spec.shape),)


@dataclass(frozen=True)
class Item:
    weight: SourceWeight
    action: str  # KEEP: bytes as stored; TO_BF16: decode FP8/FP4; TO_INT8: decode then quantize per channel
    outputs: tuple[OutTensor, ...]  # for TO_INT8 in the format's order: weight, scale[, offset]
    split: tuple[int, int, int] | None = None  # (dim, start, stop): only this slice of the source tensor

    @property
    def rows(self) -> tuple[int, int]:
        """The source rows (dim 0) this item reads."""
        if self.split is not None and self.split[0] == 0:
            return self.split[1], self.split[2]
        return 0, self.weight.spec.shape[0] if self.weight.spec.shape else 1

    @property
    def cols(self) -> tuple[int, int] | None:
        """The source columns (dim 1) kept from every row read, when the split is on dim 1."""
        return (self.split[1], self.split[2]) if self.split is not None and self.split[0] == 1 else None

    @property
    def source_bytes(self) -> int:
        """Bytes of the source this item consumes (its share of the tensor and its scale)."""
        start, stop = self.rows
        full = self.weight.spec.shape[0] if self.weight.spec.shape else 1
        share = self.weight.nbytes * (stop - start) // max(full, 1)
        if self.cols is not None:
            share = share * (self.cols[1] - self.cols[0]) // self.weight.spec.shape[1]
        return share


@dataclass(frozen=True)
class Part:
    name: str
    items: tuple[Item, ...]

    @property
    def tensors(self) -> list[OutTensor]:
        # Widest dtypes first (stable), so every tensor's data is aligned to its element size for mmap readers.
        return sorted((t for item in self.items for t in item.outputs), key=lambda t: -t.dtype.itemsize)

    @property
    def nbytes(self) -> int:
        return file_size(self.tensors, PART_METADATA)


@dataclass(frozen=True)
class Plan:
    checkpoint: Checkpoint
    recipe: Recipe
    fmt: OutputFormat
    parts: tuple[Part, ...]

    @property
    def items(self) -> list[Item]:
        return [item for part in self.parts for item in part.items]

    @property
    def source_bytes(self) -> int:
        """Bytes read from the source, copies included."""
        return sum(item.source_bytes for item in self.items)

    def digest(self) -> str:
        return job_digest(self.checkpoint.files, [self.recipe.name, self.fmt.name], self.parts)


def job_digest(sources: list[Path], options: list, parts: Iterable[Part]) -> str:
    """Changes whenever any output byte could: the source files, the options, every output file's tensors.
    `dsconv quantize` and `dsconv shard` record it in OUT to tell a resumable run from another job."""
    files = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sources]
    layout = [(part.name, [(t.name, str(t.dtype), t.shape) for t in part.tensors]) for part in parts]
    blob = json.dumps([files, *options, layout], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _item(weight: SourceWeight, recipe: Recipe, fmt: OutputFormat) -> Item:
    int8 = recipe.is_int8(weight.spec)
    outputs = output_tensors(weight.spec, weight.encoding, weight.value.entry.dtype, fmt.int8_tensors if int8 else ())
    action = TO_INT8 if int8 else TO_BF16 if weight.encoding in DECODED else KEEP
    return Item(weight, action, outputs)


# Upper bound of one tensor's header entry besides its name, dtype and shape: the JSON punctuation and two
# data offsets of up to 20 digits each.
HEADER_ENTRY_OVERHEAD = 96
FILE_HEADER_OVERHEAD = 64  # length prefix, metadata, braces, alignment padding


def _stored_bytes(tensor: OutTensor) -> int:
    """Bytes a tensor adds to a file: its data plus an upper bound of its header entry."""
    return tensor.nbytes + len(tensor.name) + len(str(tensor.shape)) + HEADER_ENTRY_OVERHEAD


def pack(items: list, tensors_of, max_file_bytes: int) -> list[list]:
    """Split items, in order, into files whose size (header included) stays under the cap; an item larger than
    the cap gets a file of its own. `tensors_of(item)` lists the OutTensors an item writes."""
    files: list[list] = [[]]
    size = FILE_HEADER_OVERHEAD
    for item in items:
        item_bytes = sum(_stored_bytes(t) for t in tensors_of(item))
        if files[-1] and size + item_bytes > max_file_bytes:
            files.append([])
            size = FILE_HEADER_OVERHEAD
        files[-1].append(item)
        size += item_bytes
    return files


def mtp_copies(checkpoint: Checkpoint) -> list[SourceWeight]:
    """The family's per-MTP-layer copies of other tensors (msModelSlim's Ascend layout), read from the originals."""
    by_name = {w.spec.name: w for w in checkpoint.weights}
    copies = checkpoint.family.ascend_mtp_copies(checkpoint.arch)
    return [dataclasses.replace(by_name[original], spec=dataclasses.replace(by_name[original].spec, name=copy,
                                                                             mtp=True))
            for copy, original in copies.items()]


def make_plan(checkpoint: Checkpoint, recipe: Recipe, fmt: OutputFormat, max_file_bytes: int) -> Plan:
    weights = checkpoint.weights + (mtp_copies(checkpoint) if fmt.mtp_copies else [])
    items = [_item(w, recipe, fmt) for w in weights]
    groups = pack(items, lambda item: item.outputs, max_file_bytes)
    parts = tuple(Part(fmt.part_name(i, len(groups)), tuple(g)) for i, g in enumerate(groups))
    return Plan(checkpoint, recipe, fmt, parts)
