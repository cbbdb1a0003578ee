"""Paged per-layer caches (vLLM vocabulary: block tables, slot mapping), storage only.

A cache field is a [layers, num_blocks * block_size, dim] tensor; a sequence owns whole blocks listed in its
block table, and token position p of a sequence lives at slot block_table[p // block_size] * block_size +
p % block_size. MLA caches the normalized latent `c_kv` and the rotated shared key `k_pe` side by side in one
field, `c_kv_k_pe`, so decode gathers a token's latent key with one read; V3.2 adds the indexer's keys
`index_k`. A sequence whose blocks are consecutive (as a sequence running alone gets them) reads its context
as a view of the cache, and a step whose slots form one range writes into a view: no gather, no scatter, no
copy of the context per layer and step; otherwise reads gather through the sequence's slots.

Under --kv-cache-dtype int8 a field's leading `int8_dims` values (family.arch.CacheField: V3's latent, V3.2's
indexer keys) are stored as INT8 with a float32 scale per token, in `<name>.int8` and `<name>.scale`, and the
rest (V3's rope key) in `<name>.rest`, in the compute dtype; `read` returns them dequantized, `read_int8` as
stored, for products that take INT8 (the indexer's A8C8 scoring).

The cache is storage only: the scheduler's block pool (runner/engine/block_pool.py) chooses every sequence's
blocks, each step's Batch carries its block tables and slot mapping, and the worker's InputBuilder
(runner/engine/worker.py) turns them into the step's metadata (runner/models/step.py), which `write` and `read`
take. DeepSeek-V4's cache (v4_cache.py) is storage of the same kind, behind the same KVCache protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from dsconv.family.arch import DEFAULT_BLOCK_SIZE, CacheField
from dsconv.kernels.cache_int8 import dequantize_tokens, quantize_tokens
from dsconv.kernels.device import cast, takes_npu_path
from dsconv.runner.models.step import DecodeRows, SeqStep, StepMeta


# What a step tells a rank's cache to do besides writing its tokens (the scheduler's Batch carries them,
# runner/engine/batch.py): copy a forked sample's blocks, and fill a prefix hit's sequence slot.
@dataclass(frozen=True)
class Fork:
    """Sequence `child` continues from `parent`'s cache: copy each (parent block, child block) pair's contents;
    the blocks the two tables share need no copy."""
    parent: int
    child: int
    copies: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Restore:
    """Sequence `seq_id` starts at block boundary `length` from published blocks (its block table's first
    length / block_size): its slot is filled from these state blocks, (block index, state block) pairs."""
    seq_id: int
    length: int
    blocks: tuple[tuple[int, int], ...]


def cache_blocks(capacity_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """The blocks a cache asked to hold `capacity_tokens` has: whole blocks, rounded up."""
    return -(-capacity_tokens // block_size)


@runtime_checkable
class KVCache(Protocol):
    """What the engine (engine/worker.py) asks of a model's cache, whichever the family. Block accounting: its size
    in the block pool's units (num_blocks of block_size tokens): a token's entries sit in the blocks its block table
    gives, so forked samples share their full blocks; `dummy_block`: where an idle rank's throwaway token goes on an
    accelerator (None: on CPU, where a step of zero rows is fine); `device`: where its entries are, and the step's
    tensors go. Per step, before the forward: `fork` copies a parent's entries for a child, `release` forgets a
    finished sequence, `advance` is told each sequence's new positions. The model's forward writes and reads the
    entries (`write` / `read` here, v4_cache's pools for DeepSeek-V4).
    LatentCache (V3 / V3.2, below) and V4Cache (v4_cache.py) implement it. `prefix_caching`: whether the scheduler
    may hand a new sequence published blocks (engine/block_pool.py); `state_blocks`: how many state blocks such a
    sequence's slot is restored from (DeepSeek-V4: its window and compressor state; 0: a block's entries are all
    it needs), `state_start(boundary)` the first position a hit there restores."""
    num_blocks: int
    block_size: int
    dummy_block: int | None
    device: torch.device
    prefix_caching: bool
    state_blocks: int

    def state_start(self, length: int) -> int: ...

    def advance(self, seq_id: int, start: int, stop: int) -> None: ...

    def fork(self, fork: Fork) -> None: ...

    def release(self, seq_id: int) -> None: ...


class LatentCache(KVCache):
    # every entry of a token (latent, indexer key, their INT8 scales) sits in its block's slots: a published block
    # is all a sequence that starts from it needs
    prefix_caching = True
    state_blocks = 0

    def state_start(self, length: int) -> int:
        return length  # nothing before the boundary is restored

    def __init__(self, layers: int, num_blocks: int, block_size: int, fields: dict[str, CacheField],
                 dtype: torch.dtype, device: torch.device | str = "cpu", rest_dtype: torch.dtype | None = None):
        """fields: name -> what a token keeps per layer; dtype: the entries' dtype (and that of dequantized
        reads); rest_dtype: an INT8 field's unquantized part (default: dtype)."""
        self.block_size, self.num_blocks, self.device = block_size, num_blocks, torch.device(device)
        self.fields, self.dtype, self.rest_dtype, self.layers = fields, dtype, rest_dtype, layers
        # on an accelerator an idle rank's throwaway token (batch.DUMMY_SEQ_ID) writes into one block past the
        # pool's, which no sequence is ever given
        self.dummy_block = num_blocks if takes_npu_path(self.device) else None
        slots_total = (num_blocks + (self.dummy_block is not None)) * block_size

        def zeros(dim: int, part_dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(layers, slots_total, dim, dtype=part_dtype, device=self.device)

        self.data: dict[str, torch.Tensor] = {}
        for name, field in fields.items():
            if not field.int8_dims:
                self.data[name] = zeros(field.dim, dtype)
                continue
            self.data[f"{name}.int8"] = zeros(field.int8_dims, torch.int8)
            self.data[f"{name}.scale"] = zeros(field.scales, torch.float32)
            if field.dim > field.int8_dims:
                self.data[f"{name}.rest"] = zeros(field.dim - field.int8_dims, rest_dtype or dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's entries take over every layer, from the tensors themselves."""
        return sum(t.shape[0] * t.shape[2] * t.element_size() for t in self.data.values())

    def is_int8(self, name: str) -> bool:
        return self.fields[name].int8_dims > 0

    def scratch(self, tokens: int) -> LatentCache:
        """A one-layer cache of this one's fields and dtypes holding `tokens` tokens in consecutive slots from 0: a
        context-parallel prefill's whole prompt, one layer at a time."""
        return LatentCache(1, -(-tokens // self.block_size), self.block_size, self.fields, self.dtype, self.device,
                           self.rest_dtype)

    def advance(self, seq_id: int, start: int, stop: int) -> None:
        """Nothing to do: where positions start .. stop - 1 go is the step's slot mapping, from the pool's tables."""

    def write(self, layer: int, meta: StepMeta, **values: torch.Tensor) -> None:
        """values [T, dim] per field, stored at the step's slots (converted to the cache's dtype, or quantized)."""
        for name, value in values.items():
            field = self.fields[name]
            if not field.int8_dims:
                self._store(name, layer, meta, value)
                continue
            tokens = value.shape[0]
            q, scale = quantize_tokens(value[:, :field.int8_dims].reshape(tokens, field.scales, field.scale_tile))
            self._store(f"{name}.int8", layer, meta, q.view(tokens, field.int8_dims))
            self._store(f"{name}.scale", layer, meta, scale.view(tokens, field.scales))
            if field.dim > field.int8_dims:
                self._store(f"{name}.rest", layer, meta, value[:, field.int8_dims:])

    def _store(self, part: str, layer: int, meta: StepMeta, value: torch.Tensor) -> None:
        target = self.data[part][layer]
        if meta.first_slot is not None:  # one range (every decode step of one sequence): a copy into a view
            target.narrow(0, meta.first_slot, value.shape[0]).copy_(value)
        else:
            target.index_copy_(0, meta.slots, cast(value, target.dtype))

    def read(self, layer: int, seq: SeqStep, *names: str) -> list[torch.Tensor]:
        """The cached entries of the sequence's whole context, one [context_len, dim] tensor per name."""
        # consecutive blocks: a view, no gather (a single sequence's usual case)
        return [self._entries(layer, name, seq.first_slot, seq.context_len, seq.context_slots) for name in names]

    def read_decode(self, layer: int, decode: DecodeRows, name: str) -> torch.Tensor:
        """[B, max_context, dim]: the decode sequences' cached entries, padded (see decode.valid)."""
        if decode.first_slot is not None:
            return self._entries(layer, name, decode.first_slot, decode.max_context, None)[None]
        return self.read_slots(layer, name, decode.slots)

    def stored_rows(self, layer: int, slots: torch.Tensor | None, count: int) -> dict[str, torch.Tensor]:
        """Every stored tensor's rows at these slots of one layer ({name: [count, dim]}, INT8 parts as stored), or,
        with slots None, empty tensors of that shape to receive them in."""
        if slots is None:
            return {name: torch.empty(count, t.shape[2], dtype=t.dtype, device=t.device)
                    for name, t in self.data.items()}
        return {name: t[layer].index_select(0, slots) for name, t in self.data.items()}

    def read_slots(self, layer: int, name: str, slots: torch.Tensor) -> torch.Tensor:
        """[*slots.shape, dim]: the entries at these slots."""
        return self._entries(layer, name, None, 0, slots)

    def read_int8(self, layer: int, name: str, seq: SeqStep | None = None,
                  decode: DecodeRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """An INT8 field as stored, (int8 [..., int8_dims], float32 scales [..., scales]: one per tile), for one
        sequence's context ([C, ...]) or a decode group's ([B, max_context, ...])."""
        one_range = False  # a decode group of one sequence whose context is one range: read as a view, batch of 1
        if seq is not None:
            where = (seq.first_slot, seq.context_len, seq.context_slots)
        elif decode.first_slot is not None:
            where, one_range = (decode.first_slot, decode.max_context, None), True
        else:
            where = (None, 0, decode.slots)
        q, scale = (self._rows(self.data[f"{name}.{part}"][layer], *where) for part in ("int8", "scale"))
        return (q[None], scale[None]) if one_range else (q, scale)

    def _entries(self, layer: int, name: str, first_slot: int | None, count: int,
                 slots: torch.Tensor | None) -> torch.Tensor:
        """A field's entries at one range of slots (first_slot, count) or at `slots`, in the cache's dtype: as
        stored, or dequantized from INT8 (a new tensor)."""
        field = self.fields[name]
        if not field.int8_dims:
            return self._rows(self.data[name][layer], first_slot, count, slots)
        q, scale = (self._rows(self.data[f"{name}.{part}"][layer], first_slot, count, slots)
                    for part in ("int8", "scale"))
        tiles = (*q.shape[:-1], field.scales, field.scale_tile)
        values = dequantize_tokens(q.view(tiles), scale[..., None], self.dtype).view(*q.shape)
        if field.dim == field.int8_dims:
            return values
        rest = self._rows(self.data[f"{name}.rest"][layer], first_slot, count, slots)
        return torch.cat([values, cast(rest, self.dtype)], dim=-1)

    @staticmethod
    def _rows(stored: torch.Tensor, first_slot: int | None, count: int, slots: torch.Tensor | None) -> torch.Tensor:
        if first_slot is not None:
            return stored.narrow(0, first_slot, count)
        # index_select: tensor[index]'s gather without advanced indexing's per-call setup
        return torch.index_select(stored, 0, slots.flatten()).view(*slots.shape, -1)

    def fork(self, fork: Fork) -> None:
        """A forked sequence's own blocks get the contents of its parent's (every field and layer); the blocks
        they share hold them already. Its slots are read from its block table at its first step."""
        if not fork.copies:
            return
        source = torch.tensor([p for p, _ in fork.copies], device=self.device)
        target = torch.tensor([c for _, c in fork.copies], device=self.device)
        offsets = torch.arange(self.block_size, device=self.device)
        source_slots = (source[:, None] * self.block_size + offsets).flatten()
        target_slots = (target[:, None] * self.block_size + offsets).flatten()
        for stored in self.data.values():
            stored.index_copy_(1, target_slots, stored.index_select(1, source_slots))

    def release(self, seq_id: int) -> None:
        """Nothing to forget: a finished (or preempted) sequence's blocks are the pool's to reuse."""

    def transfer_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(block views, state views): every stored tensor's storage as [units, unit_bytes] uint8, one unit a block
        of one layer (its block_size slots), in a fixed order; a peer with the same model and cache settings
        enumerates the same views (P/D disaggregation moves blocks this way, engine/kv_transfer.py). No state."""
        return [block_view(t[layer], self.block_size) for t in self.data.values() for layer in range(self.layers)], []


def block_view(rows: torch.Tensor, rows_per_unit: int) -> torch.Tensor:
    """A contiguous [rows, ...] tensor as uint8 units of rows_per_unit rows: [rows / rows_per_unit, bytes]."""
    if not rows.is_contiguous():  # a copy would not be the cache's storage
        raise ValueError(f"a cache tensor of shape {tuple(rows.shape)} is not contiguous")
    return rows.view(torch.uint8).view(rows.shape[0] // rows_per_unit, -1)
