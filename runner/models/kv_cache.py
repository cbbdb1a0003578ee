"""Paged per-layer caches (vLLM vocabulary: block tables, slot mapping) and one step's token metadata.

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

The cache allocates nothing: the scheduler's block pool (runner/engine/block_pool.py) chooses every sequence's
blocks and each step's Batch carries its block tables and slot mapping, which `prepare_meta` turns into the
step's metadata. DeepSeek-V4's state (window, compressors) is in v4_state.py, with the same two methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch.nn.utils.rnn import pad_sequence

from dsconv.family.arch import CacheField
from dsconv.kernels.attention import causal_mask
from dsconv.kernels.cache_int8 import dequantize_tokens, quantize_tokens
from dsconv.kernels.device import cast, takes_npu_path
from dsconv.runner.models.batch import Batch, CPShare, Fork, cp_positions, dummy_batch, slots

BLOCK_SIZE = 16  # tokens per cache block: dsrun's paged caches allocate and table whole blocks


def cache_blocks(capacity_tokens: int) -> int:
    """The blocks a cache asked to hold `capacity_tokens` has: whole blocks, rounded up."""
    return -(-capacity_tokens // BLOCK_SIZE)

# The most context rows (padded) one batched decode call gathers: a step's one-token sequences are split into
# groups under it, so the gather stays bounded however long contexts grow. 65536 rows of V3's latent (576
# values) are 151 MB in float32, 75 MB in BF16; V3.2's indexer keys (128 values) a quarter of that. A sequence
# whose context alone is longer gets a group of its own, which gathers its context as a loop over sequences would.
DECODE_GATHER_ROWS = 65536


@dataclass(frozen=True)
class SeqStep:
    seq_id: int
    start: int  # this sequence's rows in the flattened step
    stop: int
    context_len: int  # tokens cached for the sequence once this step's tokens are written
    # paged caches only (DeepSeek-V4's state needs neither):
    context_slots: torch.Tensor | None = None  # [context_len] the cache slots of positions 0 .. context_len - 1
    causal: torch.Tensor | None = None  # [query_len, context_len] True where query i (position context_len -
    #                                     query_len + i) may look; None for one query, which sees everything
    first_slot: int | None = None  # set when context_slots are first_slot .. first_slot + context_len - 1, i.e.
    #                                the block table is consecutive blocks: the context is then read as a view

    @property
    def query_len(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class DecodeRows:
    """A group of the step's one-token sequences (decodes), attended in one batched call: their contexts side by
    side, each padded to the longest. Gathering B padded contexts reads B * max_context entries where a loop over
    the sequences reads their sum (bounded by DECODE_GATHER_ROWS); it replaces a dozen calls per sequence and
    layer with a dozen per group and layer."""
    rows: slice | torch.Tensor  # their rows in the step: a slice when they are rows 0 .. B - 1, else [B] indices
    slots: torch.Tensor  # [B, max_context] the slots of positions 0 .. context_len - 1, padded with slot 0
    valid: torch.Tensor | None  # [B, max_context] True at a real position; None when no context is padded
    first_slot: int | None  # one sequence whose context is one range of slots: read as a view, no gather

    @property
    def max_context(self) -> int:
        return self.slots.shape[1]


@dataclass(frozen=True)
class StepMeta:
    seqs: list[SeqStep]
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64: where each token's cache entries go
    first_slot: int | None = None  # set when slots are first_slot .. first_slot + T - 1 (always for one token)
    decodes: tuple[DecodeRows, ...] = ()  # paged caches: the one-token sequences, in groups
    cp: CPStep | None = None  # a context-parallel prefill's share (then `seqs` is empty)


@dataclass(frozen=True)
class CPStep:
    """This rank's share of a context-parallel prefill (runner/models/batch.py, CPShare): its rows are the
    positions `positions` of a `length`-token prompt. Each layer gathers the group's new cache entries (every
    member's rows, padded to `most`, member after member) and puts them in position order (`order`) into
    `scratch`, a one-layer cache of the whole prompt that this rank's queries attend over as `seq`; the owner
    also writes them into its own cache (`owner_meta`)."""
    positions: torch.Tensor  # [T] this rank's positions, ascending
    length: int
    most: int  # the most positions any member feeds
    order: torch.Tensor  # [length]: the gathered row of each position (the gather is in the members' rank order)
    scratch: LatentCache
    scratch_meta: StepMeta  # writes positions 0 .. length - 1 to the scratch
    seq: SeqStep  # this rank's queries over the scratch (causal by position)
    owner_meta: StepMeta | None  # the owner's: writes the prompt's entries to its cache


def concat(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """torch.cat of int64 [n] parts, without a call for the common one-sequence step (or an empty step)."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=device)


def cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat of parts along dim 0 (a new tensor), leaving out the empty ones by their sizes, which the host
    knows: no kernel is handed a zero-size tensor, as an accelerator's idle ranks and first steps would otherwise
    be (a state that holds nothing yet). At least one part has rows."""
    parts = [part for part in parts if part.shape[0]]
    return parts[0].clone() if len(parts) == 1 else torch.cat(parts)


def rows_from(t: torch.Tensor, start: int) -> torch.Tensor:
    """A copy of t[start:], made without a kernel on zero rows when nothing is left."""
    if start < t.shape[0]:
        return t[start:].clone()
    return torch.empty(0, *t.shape[1:], dtype=t.dtype, device=t.device)


def pad_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """[n_i, d] parts -> [B, max n_i, d], zero-padded (pad_sequence), at least one row wide. An empty part is
    given a zero row instead, so no kernel sees a zero-size tensor; callers mask by the true lengths
    (`lengths_mask`), which leaves the row out."""
    like = parts[0]
    return pad_sequence([part if part.shape[0] else torch.zeros(1, *like.shape[1:], dtype=like.dtype,
                                                                 device=like.device) for part in parts],
                        batch_first=True)


def _range_start(ints: list[int]) -> int | None:
    """ints[0] when ints are ints[0], ints[0] + 1, ... (a range), else None (also for no ints)."""
    if ints and ints == list(range(ints[0], ints[0] + len(ints))):
        return ints[0]
    return None


def gather_groups(rows: list[int]) -> list[list[int]]:
    """Items that each gather rows[i] rows, padded to their group's longest -> groups of their indices, in order: a
    new group whenever the padded gather, (group size) x (its longest), would pass DECODE_GATHER_ROWS. An item
    longer than that alone gets a group of its own."""
    groups: list[list[int]] = []
    longest = 0  # the last group's longest
    for i, n in enumerate(rows):
        if groups and (len(groups[-1]) + 1) * max(longest, n) <= DECODE_GATHER_ROWS:
            groups[-1].append(i)
            longest = max(longest, n)
        else:
            groups.append([i])
            longest = n
    return groups


def lengths_mask(lengths: list[int], device: torch.device) -> torch.Tensor:
    """[B, max(lengths)] bool, True where row i has a real entry (j < lengths[i]): the valid part of sequences
    padded to the longest."""
    return torch.arange(max(lengths), device=device) < torch.tensor(lengths, device=device)[:, None]


@runtime_checkable
class KVCache(Protocol):
    """What the engine (engine/worker.py) asks of a model's cache, whichever the family: its size in the block
    pool's units (num_blocks of block_size tokens; `paged`: forked samples share their full blocks), and per step
    a batch's metadata, forks, releases and an idle rank's throwaway batch. LatentCache (V3 / V3.2, below) and
    V4Cache (v4_state.py) implement it; the model's forward writes and reads its own entries."""
    num_blocks: int
    block_size: int
    paged: bool

    def prepare_meta(self, batch: Batch) -> StepMeta: ...

    def fork(self, fork: Fork) -> None: ...

    def release(self, seq_id: int) -> None: ...

    def dummy_batch(self) -> Batch | None: ...


class LatentCache(KVCache):
    paged = True  # a token's entries sit in its block: samples forked from one prompt share its full blocks
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
        self.lengths: dict[int, int] = {}  # seq_id -> tokens cached, as of its last step
        self.context_slots: dict[int, torch.Tensor] = {}  # seq_id -> [length] the slots of its positions so far

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's entries take over every layer, from the tensors themselves."""
        return sum(t.shape[0] * t.shape[2] * t.element_size() for t in self.data.values())

    def is_int8(self, name: str) -> bool:
        return self.fields[name].int8_dims > 0

    def prepare_meta(self, batch: Batch) -> StepMeta:
        """The step's metadata (positions, slots, each sequence's context and causal mask, the decode groups)
        from a batch whose block tables the scheduler chose; the token ids are not read, and the batch's releases
        are the caller's to apply first (the worker's prepare_inputs)."""
        if batch.cp is not None:
            return self._prepare_cp(batch.cp)
        seqs, positions = [], []
        for i, seq_id in enumerate(batch.seq_ids):
            row, stop, context = batch.span(i)
            n_new, start = stop - row, context - (stop - row)
            table = batch.block_tables[i]
            new_slots = torch.tensor(batch.slot_mapping[row:stop], dtype=torch.long, device=self.device)
            if start and self.lengths.get(seq_id) == start:  # extended once per step, read by every layer
                context_slots = torch.cat([self.context_slots[seq_id], new_slots])
            else:
                context_slots = torch.tensor(slots(table, self.block_size, 0, context), dtype=torch.long,
                                             device=self.device)
            self.lengths[seq_id], self.context_slots[seq_id] = context, context_slots
            causal = causal_mask(n_new, context, self.device) if n_new > 1 else None
            first_block = _range_start(table)  # consecutive blocks: the context is one range of slots
            seqs.append(SeqStep(seq_id, row, stop, context, context_slots, causal,
                                None if first_block is None else first_block * self.block_size))
            positions.append(torch.arange(start, context, device=self.device))
        step_slots = torch.tensor(batch.slot_mapping, dtype=torch.long, device=self.device)
        return StepMeta(seqs, concat(positions, self.device), step_slots, _range_start(batch.slot_mapping),
                        self._decode_groups(seqs))

    def _prepare_cp(self, cp: CPShare) -> StepMeta:
        device, length, size = self.device, cp.length, len(cp.group)
        shares = [cp_positions(length, size, member) for member in range(size)]
        most = max(map(len, shares))
        order = torch.empty(length, dtype=torch.long, device=device)
        ranks = sorted(cp.group)  # the gather is in rank order; members are in group order, the owner first
        for member, share in enumerate(shares):
            order[share] = torch.arange(len(share), device=device) + ranks.index(cp.group[member]) * most
        positions = torch.tensor(shares[cp.member], dtype=torch.long, device=device)
        everything = torch.arange(length, device=device)
        scratch = LatentCache(1, -(-length // self.block_size), self.block_size, self.fields, self.dtype, device,
                              self.rest_dtype)
        causal = positions[:, None] >= everything[None]  # [T, length]
        seq = SeqStep(cp.seq_id, 0, len(shares[cp.member]), length, everything, causal, 0)
        owner_meta = None
        if cp.member == 0:
            owner_slots = slots(list(cp.block_table), self.block_size, 0, length)
            owner_meta = StepMeta([], everything, torch.tensor(owner_slots, dtype=torch.long, device=device),
                                  _range_start(owner_slots))
        step = CPStep(positions, length, most, order, scratch, StepMeta([], everything, everything, 0), seq,
                      owner_meta)
        return StepMeta([], positions, positions, None, (), step)

    def _decode_groups(self, seqs: list[SeqStep]) -> tuple[DecodeRows, ...]:
        """The one-token sequences in step order, in groups whose padded gather stays under DECODE_GATHER_ROWS."""
        decodes = [seq for seq in seqs if seq.query_len == 1]
        return tuple(self._decode_rows([decodes[i] for i in group])
                     for group in gather_groups([seq.context_len for seq in decodes]))

    def _decode_rows(self, decodes: list[SeqStep]) -> DecodeRows:
        rows = [seq.start for seq in decodes]
        lens = [seq.context_len for seq in decodes]
        longest = max(lens)
        padded = torch.nn.utils.rnn.pad_sequence([seq.context_slots for seq in decodes], batch_first=True)
        valid = None
        if min(lens) < longest:
            valid = lengths_mask(lens, self.device)
        first_rows = rows == list(range(len(rows)))  # a slice of the step: views, no index copies
        return DecodeRows(slice(0, len(rows)) if first_rows else torch.tensor(rows, device=self.device), padded, valid,
                          decodes[0].first_slot if len(decodes) == 1 else None)

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

    def dummy_batch(self) -> Batch | None:
        """An idle rank's step on this device: the throwaway token in its own block, or None where a step of zero
        rows is fine (CPU)."""
        return None if self.dummy_block is None else dummy_batch(self.dummy_block, self.block_size)

    def release(self, seq_id: int) -> None:
        """Forgets a finished (or preempted) sequence; its blocks are the pool's to reuse."""
        self.lengths.pop(seq_id, None)
        self.context_slots.pop(seq_id, None)
