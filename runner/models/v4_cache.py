"""DeepSeek-V4's KV cache: tensors allocated once, at start-up, addressed by the scheduler's block tables and by
sequence slots. Storage only, as LatentCache (kv_cache.py): the step's metadata (V4Step, below, built by the
worker's InputBuilder) says where each step reads and writes, and the model (deepseek_v4.py) does it.

Cache groups, per layer (r: the layer's compress ratio, or the indexer's, csa_compress_rate):
- **Compressed entries** (CSA r = 4, HCA r = 128 on the hub) **and the indexer's compressed keys** (CSA layers)
  are paged by the sequence's block table, the same table of blocks of block_size tokens that V3's latent cache
  uses. A block keeps `entry_slots(r, block_size)` = max(1, block_size / r) entries of each group: entry e (which
  pools tokens e*r .. e*r + r - 1) lives in the block of its last token, at slot e mod (block_size / r) when
  r <= block_size, else alone in that block (the group's slot in the r / block_size - 1 blocks before stays
  empty: for HCA at block size 16, 1 entry slot per 16 tokens where 1 per 128 would do). What a block holds
  therefore depends only on the tokens up to its end, so every block boundary of the token sequence is a prefix
  boundary for every group: a prefix cache can hit at each block. (vLLM's hybrid manager gives a compressed block
  block_size entries, block_size x r tokens, so its V4 hits start at 4K to 16K tokens.)
- **Sequence slots**, `max_seqs` of them (the scheduler's --max-num-seqs per DP rank), each of a fixed size: a
  sequence takes one at its first step and gives it back when released. A slot holds
  - the sliding window: the last `sliding_window` keys (= values, already rotated) of every layer, position p at
    row p mod sliding_window. A row no query can reach again is overwritten in place by the next token, so the
    window group holds sliding_window tokens per sequence and never grows (where vLLM frees a sliding-window
    layer's out-of-reach blocks to its pool, here they are reused in the slot);
  - each compressor's unfinished window: its projected rows and gates (position p at row p mod r), and for the
    overlapping (CSA) compressors the last complete window's first series with its gates, which the next entry
    pools (gates -inf before the first window: weight 0).

Forked samples share the prompt's full blocks (the scheduler's pool shares them) and get copies of the parent's
partial last block and of its slot. The cache keeps, per sequence, only its slot number and its length (to check
that each step continues where the last stopped).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsconv.family.arch import DEFAULT_BLOCK_SIZE
from dsconv.family.deepseek_v4 import AttnType, V4Config, attn_type_of
from dsconv.kernels.device import takes_npu_path
from dsconv.runner.models.batch import Fork
from dsconv.runner.models.kv_cache import KVCache, cache_blocks

DEFAULT_MAX_SEQS = 16  # sequence slots when none is asked for (the scheduler's default --max-num-seqs)


def entry_slots(ratio: int, block_size: int) -> int:
    """Entries of one compressed group a block keeps (ratio and block_size are powers of two)."""
    return max(1, block_size // ratio)


def entry_slot(block_table: list[int], entry: int, ratio: int, block_size: int) -> int:
    """Where entry `entry` of a sequence lives in a group's entry pool: in the block of its window's last token."""
    per_block = entry_slots(ratio, block_size)
    block = block_table[((entry + 1) * ratio - 1) // block_size]
    return block * per_block + (entry % per_block if ratio <= block_size else 0)


@dataclass
class CompressorPool:
    """One compressor's storage in one layer: its entries (paged) and each sequence slot's unfinished window."""
    ratio: int
    overlap: bool
    entries: torch.Tensor  # [blocks * entry_slots, dim]
    kv: torch.Tensor  # [slots * ratio, series * dim]: projected rows, sequence slot s at rows s * ratio + p % ratio
    gate: torch.Tensor  # [slots * ratio, series * dim] float32: their gates, the window slot's bias `ape` added
    prev_kv: torch.Tensor | None  # [slots, ratio, dim] overlap only: the last complete window's first series
    prev_gate: torch.Tensor | None  # [slots, ratio, dim] float32; -inf before the first window

    @classmethod
    def allocate(cls, ratio: int, dim: int, overlap: bool, blocks: int, block_size: int, slots: int,
                 dtype: torch.dtype, device: torch.device) -> CompressorPool:
        width = (2 if overlap else 1) * dim
        entries = torch.zeros(blocks * entry_slots(ratio, block_size), dim, dtype=dtype, device=device)
        return cls(ratio, overlap, entries, torch.zeros(slots * ratio, width, dtype=dtype, device=device),
                   torch.zeros(slots * ratio, width, dtype=torch.float32, device=device),
                   torch.zeros(slots, ratio, dim, dtype=dtype, device=device) if overlap else None,
                   torch.zeros(slots, ratio, dim, dtype=torch.float32, device=device) if overlap else None)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.entries, self.kv, self.gate, self.prev_kv, self.prev_gate) if t is not None]

    def start(self, slot: int) -> None:
        """A sequence starts in `slot`: no window before its first (its unfinished rows are written before read)."""
        if self.overlap:
            self.prev_gate[slot] = float("-inf")

    def copy_slot(self, source: int, target: int) -> None:
        r = self.ratio
        self.kv[target * r:(target + 1) * r] = self.kv[source * r:(source + 1) * r]
        self.gate[target * r:(target + 1) * r] = self.gate[source * r:(source + 1) * r]
        if self.overlap:
            self.prev_kv[target], self.prev_gate[target] = self.prev_kv[source], self.prev_gate[source]


@dataclass
class LayerPool:
    window: torch.Tensor  # [slots * sliding_window, head_dim]: slot s, position p at row s * window + p % window
    compressor: CompressorPool | None  # CSA and HCA layers
    indexer: CompressorPool | None  # CSA layers: the indexer's own compressed keys

    def compressors(self) -> list[CompressorPool]:
        return [c for c in (self.compressor, self.indexer) if c is not None]

    def tensors(self) -> list[torch.Tensor]:
        return [self.window, *(t for c in self.compressors() for t in c.tensors())]


class V4Cache(KVCache):
    paged = True  # entries sit in their blocks: forked samples share the prompt's full blocks

    def __init__(self, cfg: V4Config, capacity_tokens: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 block_size: int = DEFAULT_BLOCK_SIZE, max_seqs: int = DEFAULT_MAX_SEQS):
        """capacity_tokens: the tokens the paged groups hold (whole blocks); max_seqs: the sequence slots; entries
        and state in `dtype` (the model's compute dtype), gates in float32."""
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.block_size, self.max_seqs = block_size, max_seqs
        self.num_blocks = cache_blocks(capacity_tokens, block_size)
        self.window = cfg.sliding_window
        # on an accelerator an idle rank's throwaway token writes into one block and one slot past the pool's, which
        # no sequence is ever given
        npu = takes_npu_path(self.device)
        self.dummy_block = self.num_blocks if npu else None
        blocks, slots = self.num_blocks + npu, max_seqs + npu
        self.layers: list[LayerPool] = []
        for ratio in cfg.compress_ratios[:cfg.num_hidden_layers]:
            attn_type, compressor, indexer = attn_type_of(ratio), None, None
            if attn_type is not AttnType.SLIDING:
                compressor = CompressorPool.allocate(ratio, cfg.head_dim, attn_type is AttnType.CSA, blocks, block_size,
                                                     slots, dtype, self.device)
            if attn_type is AttnType.CSA:
                indexer = CompressorPool.allocate(cfg.csa_compress_rate, cfg.index_head_dim, True, blocks, block_size,
                                                  slots, dtype, self.device)
            window = torch.zeros(slots * self.window, cfg.head_dim, dtype=dtype, device=self.device)
            self.layers.append(LayerPool(window, compressor, indexer))
        self.free_slots = list(range(slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.slots: dict[int, int] = {}  # seq_id -> its sequence slot
        self.lengths: dict[int, int] = {}  # seq_id -> tokens it has taken in

    # -- sizes ---------------------------------------------------------------------------------------------------

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the cache: its only storage."""
        return [t for layer in self.layers for t in layer.tensors()]

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes in every paged group and layer, from the tensors themselves."""
        return sum(c.entries[:entry_slots(c.ratio, self.block_size)].nbytes
                   for layer in self.layers for c in layer.compressors())

    @property
    def bytes_per_seq(self) -> int:
        """Bytes one sequence slot takes: every layer's window and compressor state."""
        per_slot = 0
        for layer in self.layers:
            per_slot += layer.window[:self.window].nbytes
            for c in layer.compressors():
                per_slot += c.kv[:c.ratio].nbytes + c.gate[:c.ratio].nbytes
                per_slot += c.prev_kv[0].nbytes + c.prev_gate[0].nbytes if c.overlap else 0
        return per_slot

    def ratios(self) -> list[int]:
        """The paged groups' ratios, each once (the indexer's keys share the CSA entries' geometry)."""
        return sorted({c.ratio for layer in self.layers for c in layer.compressors()})

    # -- the KVCache protocol ------------------------------------------------------------------------------------

    def advance(self, seq_id: int, start: int, stop: int) -> None:
        """The sequence's positions start .. stop - 1 come this step: a new sequence (start 0) takes a slot; a running
        one must continue where it stopped (no gap, no rewind)."""
        if self.lengths.get(seq_id, 0) != start:
            raise ValueError(f"invalid step batch: sequence {seq_id} continues at position {start}, its cache holds "
                             f"{self.lengths.get(seq_id, 0)} tokens")
        if seq_id not in self.slots:
            self.slots[seq_id] = self._take_slot(seq_id)
        self.lengths[seq_id] = stop

    def _take_slot(self, seq_id: int) -> int:
        if not self.free_slots:
            raise ValueError(f"invalid step batch: sequence {seq_id} finds no free sequence slot (the cache has "
                             f"{self.max_seqs}: --max-num-seqs)")
        slot = self.free_slots.pop()
        for layer in self.layers:
            for compressor in layer.compressors():
                compressor.start(slot)
        return slot

    def fork(self, fork: Fork) -> None:
        """A forked sequence continues from a copy of its parent's slot and partial block (the full ones are
        shared)."""
        slot = self._take_slot(fork.child)
        source = self.slots[fork.parent]
        w = self.window
        parent_blocks = torch.tensor([p for p, _ in fork.copies], dtype=torch.long, device=self.device)
        child_blocks = torch.tensor([c for _, c in fork.copies], dtype=torch.long, device=self.device)
        for layer in self.layers:
            layer.window[slot * w:(slot + 1) * w] = layer.window[source * w:(source + 1) * w]
            for c in layer.compressors():
                c.copy_slot(source, slot)
                if fork.copies:
                    per_block = entry_slots(c.ratio, self.block_size)
                    offsets = torch.arange(per_block, device=self.device)
                    c.entries.index_copy_(0, (child_blocks[:, None] * per_block + offsets).flatten(),
                                          c.entries.index_select(0, (parent_blocks[:, None] * per_block + offsets)
                                                                 .flatten()))
        self.slots[fork.child], self.lengths[fork.child] = slot, self.lengths[fork.parent]

    def release(self, seq_id: int) -> None:
        """A finished (or preempted) sequence's slot is free again; its blocks are the pool's to reuse."""
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        self.lengths.pop(seq_id, None)
