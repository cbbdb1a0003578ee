"""Byte arithmetic from config.json alone: what the converter writes per tensor, what each rank maps, and
how much KV cache a sequence needs. Used by `dsconv plan` (before anything is downloaded) and by
`dsconv shard --dry-run`.

Every figure goes through the placement table (family.placement), so the plan cannot disagree with the
sharder about which rank holds what.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Iterator, NamedTuple

import torch

from dsconv.family.arch import Family, TensorSpec
from dsconv.convert.formats import WEIGHT_AND_SCALE
from dsconv.convert.plan import STORED_DTYPES, output_tensors
from dsconv.family.expert_map import ExpertMap, ModelKey
from dsconv.family.recipes import Recipe
from dsconv.family.layout import Layout
from dsconv.family.placement import CATEGORIES, Placement, category, place, place_companion

CACHE_DTYPE = torch.bfloat16  # KV-cache entries, and V4 compressor state (transformers keeps it in the model dtype)
ACTIVATION_DTYPE = torch.bfloat16  # dsrun's default compute dtype
# How a row travels in the MoE exchange (runner/models/moe.py): its activations (W8A8 experts: INT8 with a float32
# per-token scale), then its expert's local index as int64, packed as bytes into one all-to-all
INT8_ITEMSIZE, SCALE_ITEMSIZE, EXPERT_ID_ITEMSIZE = 1, 4, 8
# The receiver holds two copies of the rows through the experts: the exchange's columns, then the same rows regrouped
# by expert (the packed all-to-all buffer is freed once unpacked)
RECEIVED_COPIES = 2


class Entry(NamedTuple):
    spec: TensorSpec
    weight_bytes: int  # the whole, unsplit main tensor as written
    companion_bytes: int  # its per-channel scale (0 when the tensor stays float)


def entries(family: Family, arch: object, recipe: Recipe | None, mtp: bool = True) -> Iterator[Entry]:
    """Every output tensor of the model as the shards hold it; `recipe=None` keeps everything float (the BF16
    plan)."""
    for spec in family.inventory(arch):
        if spec.mtp and not mtp:
            continue
        int8 = recipe is not None and recipe.is_int8(spec)
        weight, *companions = output_tensors(spec, spec.encoding, STORED_DTYPES[spec.encoding],
                                             WEIGHT_AND_SCALE if int8 else ())
        yield Entry(spec, weight.nbytes, sum(t.nbytes for t in companions))


def redundant_map(family: Family, arch: object, layout: Layout, redundant: int) -> ExpertMap | None:
    """The round-robin map of `redundant` extra experts, for counting their bytes (every placement of R redundant
    experts gives each EP rank the same slots); None for none."""
    if not redundant:
        return None
    key = ModelKey.of(family.name, arch.n_routed_experts, (spec.name for spec in family.inventory(arch)))
    return ExpertMap.round_robin(list(key.layers), key.experts, redundant, layout.ep)


def _share(nbytes: int, spec: TensorSpec, split: tuple[int, int, int] | None) -> int:
    if split is None:
        return nbytes
    dim, start, stop = split
    # Splits are even and along a whole dimension, so this division is exact
    return nbytes * (stop - start) // spec.shape[dim]


def _pieces(items: Iterable[Entry], family: Family, arch: object, layout: Layout,
            experts: ExpertMap | None = None) -> Iterator[tuple[Placement, str, int]]:
    """(placement, category, bytes) for every shard piece; a column-split weight's whole scale once."""
    for spec, weight_bytes, companion_bytes in items:
        bucket = category(spec)
        placements = place(spec, family, arch, layout, experts)
        for placement in placements:
            yield placement, bucket, _share(weight_bytes, spec, placement.split)
        if not companion_bytes:
            continue
        for placement in {place_companion(p, layout) for p in placements}:
            # place_companion gives a row split (the scale's rows follow the weight's) or the whole scale
            yield placement, bucket, _share(companion_bytes, spec, placement.split)


def _empty() -> dict[str, int]:
    return dict.fromkeys(CATEGORIES, 0)


def footprint(items: Iterable[Entry], family: Family, arch: object, layout: Layout,
              experts: ExpertMap | None = None) -> tuple[dict[int, dict[str, int]], dict[str, dict[str, int]]]:
    """rank_bytes and directory_bytes in one pass over the tensors (with an expert map, each replica counted)."""
    per_rank = {rank: _empty() for rank in range(layout.world_size)}
    per_dir: dict[str, dict[str, int]] = defaultdict(_empty)
    for placement, bucket, nbytes in _pieces(items, family, arch, layout, experts):
        per_dir[placement.directory][bucket] += nbytes
        for rank in placement.ranks:
            per_rank[rank][bucket] += nbytes
    return per_rank, dict(per_dir)


def rank_bytes(items: Iterable[Entry], family: Family, arch: object,
               layout: Layout) -> dict[int, dict[str, int]]:
    """rank -> category -> bytes the rank maps, split tensors counting only the rank's share."""
    return footprint(items, family, arch, layout)[0]


def directory_bytes(items: Iterable[Entry], family: Family, arch: object,
                    layout: Layout) -> dict[str, dict[str, int]]:
    """Shard directory -> category -> bytes on disk: a shard read by several ranks is counted once."""
    return footprint(items, family, arch, layout)[1]


# --- KV cache ---------------------------------------------------------------------------------------------
#
# Per rank and per sequence, main decoder layers only (MTP layers excluded), entries in CACHE_DTYPE (or INT8 with
# float32 scales where --kv-cache-dtype int8 quantizes them), by the family's own formulas. Attention TP never splits these caches (MLA keeps one latent per token shared by all
# heads, V4 has one KV head), so every attention-TP rank holds the whole cache of its DP group's sequences.


def kv_cache_bytes_per_token(family: Family, arch: object, kv_cache_dtype: str = "auto") -> dict[str, float]:
    """Bytes that grow with each token of a sequence, by component (fractions where 1 entry covers n tokens)."""
    return family.kv_cache_bytes_per_token(arch, CACHE_DTYPE.itemsize, kv_cache_dtype)


def kv_cache_bytes_per_sequence(family: Family, arch: object, kv_cache_dtype: str = "auto") -> dict[str, int]:
    """Bytes each sequence holds whatever its length (V4's windows and compressor state; none for MLA)."""
    return family.kv_cache_bytes_per_sequence(arch, CACHE_DTYPE.itemsize, kv_cache_dtype)


def kv_cache_bytes(family: Family, arch: object, batch: int, seq: int, kv_cache_dtype: str = "auto") -> int:
    """One rank's cache for `batch` sequences of `seq` tokens each (batch = this rank's DP group's share)."""
    per_token = sum(kv_cache_bytes_per_token(family, arch, kv_cache_dtype).values())
    per_sequence = sum(kv_cache_bytes_per_sequence(family, arch, kv_cache_dtype).values())
    return round(batch * (seq * per_token + per_sequence))


def moe_exchange_worst_case(arch: object, layout: Layout, tokens_per_dp_rank: int, w8a8: bool) -> dict:
    """The most one rank's experts can receive in one MoE layer, and what computing it holds, for a step of
    `tokens_per_dp_rank` tokens on every attention-DP rank (an attention-TP group routes its tokens once, a share
    per rank): every token's picks on this rank's experts, up to as many as it owns, so rows = dp x tokens x
    min(top-k, experts per rank). Bytes, by part: the received rows (RECEIVED_COPIES), the experts' gate and up
    outputs and their activated product ([rows, 3 x moe_intermediate], all experts at once as a grouped kernel
    computes them), and the experts' output with its reorder to arrival order ([rows, hidden] twice), in
    ACTIVATION_DTYPE. Balanced routing receives about 1 / ep of this."""
    per_rank = arch.n_routed_experts // layout.ep
    rows = layout.dp * tokens_per_dp_rank * min(arch.num_experts_per_tok, per_rank)
    act = ACTIVATION_DTYPE.itemsize
    row_bytes = (arch.hidden_size * INT8_ITEMSIZE + SCALE_ITEMSIZE if w8a8 else arch.hidden_size * act) \
        + EXPERT_ID_ITEMSIZE
    parts = {"received rows": RECEIVED_COPIES * rows * row_bytes,
             "expert activations": rows * 3 * arch.moe_intermediate_size * act,
             "expert outputs": 2 * rows * arch.hidden_size * act}
    return {"tokens_per_dp_rank": tokens_per_dp_rank, "rows": rows, "bytes": parts, "bytes_total": sum(parts.values())}
