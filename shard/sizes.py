"""Byte arithmetic from config.json alone: what the converter writes per tensor, what each rank maps, and
how much KV cache a sequence needs. Used by `dsconv plan` (before anything is downloaded) and by
`dsconv shard --dry-run`.

Every figure goes through the placement table (shard.placement), so the plan cannot disagree with the
sharder about which rank holds what.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Iterator, NamedTuple

import torch

from dsconv.convert.arch import Encoding, Family, TensorSpec
from dsconv.convert.arch_v4_config import AttnType
from dsconv.errors import InputError
from dsconv.convert.formats import SCALE_DTYPE
from dsconv.convert.recipes import Recipe
from dsconv.convert.safetensors_io import OutTensor
from dsconv.shard.layout import Layout
from dsconv.shard.placement import CATEGORIES, Placement, category, place, place_companion

# What a float tensor becomes in the shards: FP8/FP4 decode to BF16, BF16 stays, F32/I32/I64 keep their dtype.
_FLOAT_OUTPUT = {Encoding.FP8: torch.bfloat16, Encoding.FP4: torch.bfloat16, Encoding.BF16: torch.bfloat16,
                 Encoding.F32: torch.float32, Encoding.I32: torch.int32, Encoding.I64: torch.int64}
INT8_SCALE_SUFFIX = "weight_scale"
CACHE_DTYPE = torch.bfloat16  # KV-cache entries, and V4 compressor state (transformers keeps it in the model dtype)


def output_tensors(spec: TensorSpec, int8: bool) -> list[OutTensor]:
    """The converter's output for one source tensor; for INT8 the weight first, then its per-channel scale.

    Shards drop the Ascend format's all-zero `weight_offset`: the runner quantizes symmetrically.
    """
    if not int8:
        return [OutTensor(spec.name, _FLOAT_OUTPUT[spec.encoding], spec.shape)]
    rows = spec.shape[0]
    base = spec.name.removesuffix("weight")
    return [OutTensor(spec.name, torch.int8, spec.shape),
            OutTensor(base + INT8_SCALE_SUFFIX, SCALE_DTYPE, (rows, 1))]


class Entry(NamedTuple):
    spec: TensorSpec
    weight_bytes: int  # the whole, unsplit main tensor as written
    companion_bytes: int  # its per-channel scale (0 when the tensor stays float)


def entries(family: Family, arch: object, recipe: Recipe | None, mtp: bool = True) -> Iterator[Entry]:
    """Every output tensor of the model; `recipe=None` keeps everything float (the BF16 plan)."""
    for spec in family.inventory(arch):
        if spec.mtp and not mtp:
            continue
        weight, *companions = output_tensors(spec, recipe is not None and recipe.is_int8(spec))
        yield Entry(spec, weight.nbytes, sum(t.nbytes for t in companions))


def _share(nbytes: int, spec: TensorSpec, split: tuple[int, int, int] | None) -> int:
    if split is None:
        return nbytes
    dim, start, stop = split
    # Splits are even and along a whole dimension, so this division is exact
    return nbytes * (stop - start) // spec.shape[dim]


def _pieces(items: Iterable[Entry], family: str, arch: object,
            layout: Layout) -> Iterator[tuple[Placement, str, int]]:
    """(placement, category, bytes) for every shard piece; a column-split weight's whole scale once."""
    for spec, weight_bytes, companion_bytes in items:
        bucket = category(spec)
        placements = place(spec, family, arch, layout)
        for placement in placements:
            yield placement, bucket, _share(weight_bytes, spec, placement.split)
        if not companion_bytes:
            continue
        for placement in {place_companion(p, layout) for p in placements}:
            # place_companion gives a row split (the scale's rows follow the weight's) or the whole scale
            yield placement, bucket, _share(companion_bytes, spec, placement.split)


def _empty() -> dict[str, int]:
    return dict.fromkeys(CATEGORIES, 0)


def footprint(items: Iterable[Entry], family: str, arch: object,
              layout: Layout) -> tuple[dict[int, dict[str, int]], dict[str, dict[str, int]]]:
    """rank_bytes and directory_bytes in one pass over the tensors."""
    per_rank = {rank: _empty() for rank in range(layout.world_size)}
    per_dir: dict[str, dict[str, int]] = defaultdict(_empty)
    for placement, bucket, nbytes in _pieces(items, family, arch, layout):
        per_dir[placement.directory][bucket] += nbytes
        for rank in placement.ranks:
            per_rank[rank][bucket] += nbytes
    return per_rank, dict(per_dir)


def rank_bytes(items: Iterable[Entry], family: str, arch: object,
               layout: Layout) -> dict[int, dict[str, int]]:
    """rank -> category -> bytes the rank maps, split tensors counting only the rank's share."""
    return footprint(items, family, arch, layout)[0]


def directory_bytes(items: Iterable[Entry], family: str, arch: object,
                    layout: Layout) -> dict[str, dict[str, int]]:
    """Shard directory -> category -> bytes on disk: a shard read by several ranks is counted once."""
    return footprint(items, family, arch, layout)[1]


# --- KV cache ---------------------------------------------------------------------------------------------
#
# Per rank and per sequence, main decoder layers only (MTP layers excluded), entries in CACHE_DTYPE.
# Attention TP never splits these caches: MLA keeps one latent per token shared by all heads, and V4 has one
# KV head; so every attention-TP rank holds the whole cache of its DP group's sequences.

MLA_FAMILIES = ("deepseek_v3", "deepseek_v32")
V4_FAMILY = "deepseek_v4"


def _cache_kind(family: str) -> str:
    if family not in (*MLA_FAMILIES, V4_FAMILY):
        raise InputError(f"no KV-cache model for family {family!r}")
    return "mla" if family in MLA_FAMILIES else "v4"


def kv_cache_bytes_per_token(family: str, arch: object) -> dict[str, float]:
    """Bytes that grow with each token of a sequence, by component (fractions where 1 entry covers n tokens)."""
    item = CACHE_DTYPE.itemsize
    layers = arch.num_hidden_layers
    if _cache_kind(family) == "mla":
        # MLA caches the compressed latent (kv_lora_rank) plus the shared rope key per token per layer
        parts = {"MLA latent + rope key": layers * (arch.kv_lora_rank + arch.qk_rope_head_dim) * item}
        if arch.has_indexer:
            parts["indexer keys"] = layers * arch.index_head_dim * item
        return parts
    csa, hca = _v4_layers(arch, AttnType.CSA), _v4_layers(arch, AttnType.HCA)
    return {
        # One compressed K=V entry per `ratio` tokens
        "CSA compressed KV": csa * arch.head_dim * item / arch.csa_compress_rate,
        "CSA indexer keys": csa * arch.index_head_dim * item / arch.csa_compress_rate,
        "HCA compressed KV": hca * arch.head_dim * item / arch.hca_compress_rate,
    }


def kv_cache_bytes_per_sequence(family: str, arch: object) -> dict[str, int]:
    """Bytes each sequence holds whatever its length (V4's windows and compressor state; none for MLA)."""
    if _cache_kind(family) == "mla":
        return {}
    item = CACHE_DTYPE.itemsize
    csa, hca = _v4_layers(arch, AttnType.CSA), _v4_layers(arch, AttnType.HCA)
    return {
        # Every layer keeps the last `sliding_window` K=V entries of its single KV head: a fixed buffer, counted
        # whole even for a sequence shorter than the window
        "sliding window": arch.num_hidden_layers * arch.sliding_window * arch.head_dim * item,
        "compressor state": (csa * (_compressor_state(arch.csa_compress_rate, arch.head_dim, overlap=True)
                                    + _compressor_state(arch.csa_compress_rate, arch.index_head_dim, overlap=True))
                             + hca * _compressor_state(arch.hca_compress_rate, arch.head_dim, overlap=False)) * item,
    }


def _compressor_state(ratio: int, head_dim: int, overlap: bool) -> int:
    """Elements a compressor carries between steps, at most (transformers' DeepseekV4CSACache/HCACache)."""
    width = (2 if overlap else 1) * head_dim  # CSA projects two series per token, HCA one
    buffered = (ratio - 1) * width * 2  # kv and gate of the tokens since the last closed window
    carried = 2 * head_dim if overlap else 0  # kv and gate of the previous window's first series
    return buffered + carried


def _v4_layers(arch: object, attn_type: AttnType) -> int:
    return sum(kind is attn_type for kind in arch.attn_types)


def kv_cache_bytes(family: str, arch: object, batch: int, seq: int) -> int:
    """One rank's cache for `batch` sequences of `seq` tokens each (batch = this rank's DP group's share)."""
    per_token = sum(kv_cache_bytes_per_token(family, arch).values())
    per_sequence = sum(kv_cache_bytes_per_sequence(family, arch).values())
    return round(batch * (seq * per_token + per_sequence))
