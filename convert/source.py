"""A Hugging Face checkpoint directory as users download it, validated before any output is written.

Opening checks everything that can be checked from headers: the index against the files, every file's
header against its size, every tensor against the architecture's inventory (nothing missing, nothing
left over), every FP8/FP4 weight against its scale. Values are read later, one tensor at a time.
Tensor names are the hub's from here on: a checkpoint saved by transformers is read through the family's
`hub_name`, and the MTP copies of msModelSlim's Ascend layout (our own output) are checked and left out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dsconv.family.arch import Family, TensorSpec, family_for
from dsconv.convert.decode import check_scale_shape, decoded_shape, encoding_of
from dsconv.errors import InputError
from dsconv.convert.safetensors_io import TensorEntry, read_header, read_tensor

INDEX_NAME = "model.safetensors.index.json"
ASCEND_INDEX_NAME = "quant_model_weights.safetensors.index.json"  # our (and msModelSlim's) W8A8 output
INDEX_NAMES = (INDEX_NAME, ASCEND_INDEX_NAME)
SINGLE_FILE_NAME = "model.safetensors"
W8A8_SCALE, W8A8_OFFSET = "weight_scale", "weight_offset"  # per-channel companions of an INT8 weight
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class StoredTensor:
    path: Path
    entry: TensorEntry

    def read(self) -> torch.Tensor:
        return read_tensor(self.path, self.entry)


@dataclass(frozen=True)
class SourceWeight:
    """One logical tensor of the model: its stored value and, for FP8/FP4, its block scale; for an INT8
    (W8A8) weight, its per-channel `weight_scale` [out, 1] and optional all-zero `weight_offset`."""

    spec: TensorSpec
    value: StoredTensor
    scale: StoredTensor | None
    encoding: str  # "float", "int", "fp8", "fp4" (see convert.decode) or "w8a8"
    offset: StoredTensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.entry.nbytes for t in (self.value, self.scale, self.offset) if t is not None)


@dataclass
class Checkpoint:
    root: Path
    config: dict
    family: Family
    arch: object  # the family's validated config dataclass
    block: tuple[int, int] | None  # FP8 weight block from quantization_config
    weights: list[SourceWeight]  # in inventory order
    files: list[Path]  # safetensors files, sorted

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights)

    @property
    def hub_config(self) -> dict:
        """config.json in the hub's form, describing the tensors this checkpoint holds (the names every stage uses)."""
        return self.family.hub_config(self.config, self.arch)


def _load_json(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path.parent}: no {path.name} ({what})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise InputError(f"{path}: not a JSON object ({what})")
    return value


def _weight_map(root: Path) -> dict[str, str]:
    """tensor name -> file name, from the index, or from the single file's header."""
    for index in (root / name for name in INDEX_NAMES):
        if index.exists():
            weight_map = _load_json(index, "checkpoint index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise InputError(f"{index}: no weight_map")
            return weight_map
    single = root / SINGLE_FILE_NAME
    if single.exists():
        return {name: SINGLE_FILE_NAME for name in read_header(single)}
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES or p.name.endswith(".bin.index.json"))
    if pickles:
        raise InputError(f"{root}: {pickles[0]} is a pickle checkpoint; dsconv never unpickles, "
                         f"convert it to safetensors first")
    raise InputError(f"{root}: no {INDEX_NAME} and no {SINGLE_FILE_NAME}")


def _block_size(config: dict) -> tuple[int, int] | None:
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or "weight_block_size" not in qc:
        return None
    block = qc["weight_block_size"]
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise InputError(f"config.json quantization_config.weight_block_size={block!r} is not two positive ints")
    return (block[0], block[1])


def _scale_name(family: Family, weight_name: str) -> str:
    base = weight_name.removesuffix(".weight")
    return f"{base}.{family.scale_suffix}"


def open_checkpoint(root: Path) -> Checkpoint:
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"{root}: not a directory")
    config = _load_json(root / "config.json", "model config")
    family = family_for(config)
    arch = family.parse_config(config)
    block = _block_size(config)
    weight_map = _weight_map(root)

    stored: dict[str, StoredTensor] = {}
    for file_name in sorted(set(weight_map.values())):
        path = root / file_name
        if Path(file_name).is_absolute() or ".." in Path(file_name).parts:
            raise InputError(f"{INDEX_NAME} names a file outside the checkpoint: {file_name}")
        if not path.is_file():
            listed = sum(1 for f in weight_map.values() if f == file_name)
            raise InputError(f"{file_name} is listed in the index ({listed} tensors) but missing from {root}")
        header = read_header(path)
        for name, entry in header.items():
            if weight_map.get(name) != file_name:
                raise InputError(f"{file_name} holds tensor {name}, which the index maps to {weight_map.get(name)}")
            stored[name] = StoredTensor(path, entry)
    for name, file_name in weight_map.items():
        if name not in stored:
            raise InputError(f"index maps {name} to {file_name}, but that file does not hold it")
    stored = _hub_names(stored, family)
    _drop_ascend_copies(stored, family, arch)

    weights = []
    for spec in family.inventory(arch):
        if spec.name not in stored:
            why = ("config.json declares MTP layers (num_nextn_predict_layers): an incomplete download?" if spec.mtp
                   else f"expected by {family.name} with this config.json")
            raise InputError(f"checkpoint lacks tensor {spec.name} ({why})")
        value = stored.pop(spec.name)
        base = spec.name.removesuffix("weight")
        if value.entry.dtype == torch.int8 and base + W8A8_SCALE in stored:
            weights.append(_w8a8(spec, value, stored.pop(base + W8A8_SCALE), stored.pop(base + W8A8_OFFSET, None)))
            continue
        scale = stored.pop(_scale_name(family, spec.name), None) if spec.name.endswith(".weight") else None
        weights.append(_pair(spec, value, scale, block))
    if stored:
        extra = sorted(stored)
        raise InputError(f"unexpected tensor {extra[0]} ({len(extra)} in all) not in the {family.name} inventory "
                         f"for this config.json")
    files = sorted({t.path for w in weights for t in (w.value, w.scale, w.offset) if t is not None})
    return Checkpoint(root, config, family, arch, block, weights, files)


def _hub_names(stored: dict[str, StoredTensor], family: Family) -> dict[str, StoredTensor]:
    renamed: dict[str, StoredTensor] = {}
    for name, tensor in stored.items():
        hub = family.hub_name(name)
        if hub in renamed:
            raise InputError(f"tensors {renamed[hub].entry.name} and {name} both stand for {hub}")
        renamed[hub] = tensor
    return renamed


def _drop_ascend_copies(stored: dict[str, StoredTensor], family: Family, arch) -> None:
    for copy, original in family.ascend_mtp_copies(arch).items():
        if copy not in stored:
            continue
        value, source = stored.pop(copy), stored.get(original)
        if source is None or (value.entry.dtype, value.entry.shape) != (source.entry.dtype, source.entry.shape):
            raise InputError(f"{copy} is not a copy of {original} (dtype and shape differ)")


def _pair(spec: TensorSpec, value: StoredTensor, scale: StoredTensor | None,
          block: tuple[int, int] | None) -> SourceWeight:
    try:
        encoding = encoding_of(value.entry.dtype, scale.entry.dtype if scale else None)
        if scale is not None:
            check_scale_shape(value.entry.shape, scale.entry.shape, encoding, block)
    except InputError as exc:
        raise InputError(f"{spec.name}: {exc}") from None
    shape = decoded_shape(value.entry.shape, encoding)
    if shape != spec.shape:
        raise InputError(f"{spec.name}: stored shape {shape} but config.json implies {spec.shape}")
    return SourceWeight(spec, value, scale, encoding)


def _w8a8(spec: TensorSpec, value: StoredTensor, scale: StoredTensor, offset: StoredTensor | None) -> SourceWeight:
    rows = value.entry.shape[0]
    if value.entry.shape != spec.shape:
        raise InputError(f"{spec.name}: stored INT8 shape {value.entry.shape} but config.json implies {spec.shape}")
    for companion in (scale, offset):
        if companion is not None and (companion.entry.shape != (rows, 1) or companion.entry.dtype not in
                                      (torch.float32, torch.bfloat16, torch.float16)):
            raise InputError(f"{companion.entry.name}: expected a float [{rows}, 1] per-channel tensor, found "
                             f"{companion.entry.dtype} {list(companion.entry.shape)}")
    return SourceWeight(spec, value, scale, "w8a8", offset)
