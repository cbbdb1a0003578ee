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

Under --kv-cache-dtype int8 (C8) the compressed entries, the windows and the indexer's keys are stored INT8 with a
float32 scale per row (`Rows`; family.deepseek_v4.cache_fields says which values): the rotary tail of an entry
or window row stays in the compute dtype, the indexer's keys are stored Hadamard-rotated for its A8C8 scoring,
and reads of entries and windows come back dequantized (stored in 8 bits, computed in 16). The unfinished windows
stay in the compute dtype: they are pooled again, not read by attention.

Forked samples share the prompt's full blocks (the scheduler's pool shares them) and get copies of the parent's
partial last block and of its slot. The cache keeps, per sequence, only its slot number and its length (to check
that each step continues where the last stopped).

**Prefix caching** (engine/block_pool.py): a published block's entries are all a later sequence needs of the
compressed groups, but a sequence starting at a block boundary T also needs what its slot would hold there: the
window's last sliding_window - 1 keys, each compressor's unfinished window (positions T // r * r .. T - 1) and,
for an overlapping one, the last complete window's first series. So, with `state_blocks`, each step also writes
its tokens' rows of those into **state blocks** of block_size tokens, a pool of its own that the scheduler manages
beside the blocks (block_pool.StatePool: published under the same hashes, evicted least recently used), and a hit
copies the state blocks before T into the new sequence's slot (`restore`). A state block keeps, per layer, the
block's window keys; per compressor of ratio r > block_size every position's projected rows and gates (the
unfinished window at any boundary spans several blocks); per overlapping compressor of ratio r <= block_size only
its last r positions' first series (a boundary closes its window: nothing is unfinished, and the next entry pools
that window); nothing for the others. A hit is usable at every block boundary whose state blocks are still
cached (`state_start`: the first position a hit restores); the state is stored as the slot keeps it (the window
INT8 under C8), so a restored slot is the one the sequence would have had.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsconv.errors import InputError
from dsconv.family.arch import DEFAULT_BLOCK_SIZE, CacheField
from dsconv.family.deepseek_v4 import AttnType, V4Config, attn_type_of, cache_fields
from dsconv.kernels.cache_int8 import dequantize_tokens, quantize_tokens
from dsconv.kernels.device import cast, takes_npu_path
from dsconv.runner.models.kv_cache import Fork, KVCache, Restore, block_view, cache_blocks

DEFAULT_MAX_SEQS = 16  # sequence slots when none is asked for (the scheduler's default --max-num-seqs)
# State blocks per sequence slot, for prefix caching, in hit points: one hit at a block boundary restores at most
# `reach` tokens of state (the window, or an unfinished HCA window); four per slot keep, for each sequence a DP
# rank runs, the end of its last turn and a shared prefix's boundary with room to spare for the blocks a step
# writes before they are published.
STATE_HITS_PER_SLOT = 4


def check_geometry(ratios: list[int], block_size: int) -> None:
    """Refuses, in one line, a block size whose blocks cannot keep whole entries of every compress ratio: each ratio
    and the block size must divide one another (the hub's 4 and 128 with any power-of-two block size do)."""
    for ratio in sorted(set(r for r in ratios if r)):
        if ratio % block_size and block_size % ratio:
            raise InputError(f"--block-size {block_size} cannot hold deepseek_v4's compress ratio {ratio} in whole "
                             f"entries (each must divide the other): use a power-of-two block size dividing {ratio} "
                             f"or divisible by it")


def entry_slots(ratio: int, block_size: int) -> int:
    """Entries of one compressed group a block keeps (ratio and block_size are powers of two)."""
    return max(1, block_size // ratio)


def entry_slot(block_table: list[int], entry: int, ratio: int, block_size: int) -> int:
    """Where entry `entry` of a sequence lives in a group's entry pool: in the block of its window's last token."""
    per_block = entry_slots(ratio, block_size)
    block = block_table[((entry + 1) * ratio - 1) // block_size]
    return block * per_block + (entry % per_block if ratio <= block_size else 0)


def state_rows(ratio: int, overlap: bool, block_size: int) -> int:
    """The positions of each block whose rows a compressor's state block keeps: every one when its windows span
    blocks, the last window's when it overlaps (the next entry pools that window's first series), else none."""
    if ratio > block_size:
        return block_size
    return ratio if overlap else 0


def state_reach(cfg: V4Config, block_size: int) -> int:
    """The most tokens of state a hit at a block boundary restores: the window's keys before it, and a compressor
    window spanning blocks (the overlapping one's previous window too)."""
    reach = cfg.sliding_window - 1
    for ratio in cfg.compress_ratios:  # the MTP layer's too
        if ratio > block_size:
            reach = max(reach, (2 if attn_type_of(ratio) is AttnType.CSA else 1) * ratio - 1)
        elif ratio and attn_type_of(ratio) is AttnType.CSA:
            reach = max(reach, ratio)
    return reach


def default_state_blocks(cfg: V4Config, block_size: int, max_seqs: int) -> int:
    """The state blocks a cache with prefix caching keeps: STATE_HITS_PER_SLOT hits' reach per sequence slot."""
    per_hit = -(-state_reach(cfg, block_size) // block_size) + 1  # a boundary's reach may straddle one more block
    return max_seqs * STATE_HITS_PER_SLOT * per_hit


class Rows:
    """Rows of a CacheField's `dim` values addressed by row number: as they are (--kv-cache-dtype auto), or its
    leading int8_dims INT8 with one float32 scale per row and the rest (V4's rotary tail) in the compute dtype
    (int8). Reads come back in the compute dtype (dequantized), or as stored (`read_int8`)."""

    def __init__(self, count: int, field: CacheField, dtype: torch.dtype, device: torch.device):
        self.field, self.dtype = field, dtype
        k = field.int8_dims
        self.values = self.q = self.scale = self.rest = None
        if not k:
            self.values = torch.zeros(count, field.dim, dtype=dtype, device=device)
            return
        self.q = torch.zeros(count, k, dtype=torch.int8, device=device)
        self.scale = torch.zeros(count, 1, dtype=torch.float32, device=device)
        if field.dim > k:
            self.rest = torch.zeros(count, field.dim - k, dtype=dtype, device=device)

    @property
    def int8(self) -> bool:
        return self.q is not None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.values, self.q, self.scale, self.rest) if t is not None]

    @property
    def row_bytes(self) -> int:
        return sum(t[0].nbytes for t in self.tensors())

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """values [n, dim] into rows [n]."""
        if not self.int8:
            self.values.index_copy_(0, rows, cast(values, self.dtype))
            return
        k = self.field.int8_dims
        q, scale = quantize_tokens(values[:, :k])
        self.q.index_copy_(0, rows, q)
        self.scale.index_copy_(0, rows, scale)
        if self.rest is not None:
            self.rest.index_copy_(0, rows, cast(values[:, k:], self.dtype))

    def stored(self, values: torch.Tensor) -> torch.Tensor:
        """values [n, dim] as a read gives them back once written: in a step, rows not yet read from the cache
        (a prefill chunk's own keys) are used as every later step sees them."""
        if not self.int8:
            return cast(values, self.dtype)
        k = self.field.int8_dims
        q, scale = quantize_tokens(values[:, :k])
        rounded = dequantize_tokens(q, scale, self.dtype)
        return rounded if self.rest is None else torch.cat([rounded, cast(values[:, k:], self.dtype)], dim=-1)

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [...] -> [..., dim] in the compute dtype."""
        if not self.int8:
            return _gather(self.values, rows)
        values = dequantize_tokens(_gather(self.q, rows), _gather(self.scale, rows), self.dtype)
        return values if self.rest is None else torch.cat([values, _gather(self.rest, rows)], dim=-1)

    def read_int8(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [...] -> (int8 [..., int8_dims], float32 scales [..., 1]) as stored (an all-INT8 field's rows)."""
        return _gather(self.q, rows), _gather(self.scale, rows)

    def copy(self, source: torch.Tensor, target: torch.Tensor, into: Rows | None = None) -> None:
        """Rows `source` to rows `target`, as stored, of this field or of `into` (one of the same field)."""
        for t, u in zip(self.tensors(), (into or self).tensors(), strict=True):
            u.index_copy_(0, target, t.index_select(0, source))


def _gather(stored: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return torch.index_select(stored, 0, rows.flatten()).view(*rows.shape, stored.shape[1])


@dataclass
class CompressorPool:
    """One compressor's storage in one layer: its entries (paged) and each sequence slot's unfinished window.

    A slot keeps `windows` windows of rows (position p at row p mod (windows * ratio)) and, overlapping, the first
    series of the last `windows` complete windows (window w's at w mod windows). One of each suffices when every
    step continues where the last stopped; speculative decoding rewinds over rejected drafts, whose rows may run
    into the next window (and complete the current one): two keep the accepted rows and the previous window's
    series that the rewound step still pools (`speculative_windows`)."""
    ratio: int
    overlap: bool
    windows: int
    entries: Rows  # blocks * entry_slots rows
    kv: torch.Tensor  # [slots * windows * ratio, series * dim]: projected rows
    gate: torch.Tensor  # [slots * windows * ratio, series * dim] float32: their gates, the window slot's `ape` added
    prev_kv: torch.Tensor | None  # [slots * windows, ratio, dim] overlap only: complete windows' first series
    prev_gate: torch.Tensor | None  # [slots * windows, ratio, dim] float32; -inf before the first window

    @classmethod
    def allocate(cls, ratio: int, field: CacheField, overlap: bool, blocks: int, block_size: int, slots: int,
                 dtype: torch.dtype, device: torch.device, windows: int = 1) -> CompressorPool:
        dim = field.dim
        width = (2 if overlap else 1) * dim
        entries = Rows(blocks * entry_slots(ratio, block_size), field, dtype, device)
        rows = slots * windows * ratio
        return cls(ratio, overlap, windows, entries, torch.zeros(rows, width, dtype=dtype, device=device),
                   torch.zeros(rows, width, dtype=torch.float32, device=device),
                   torch.zeros(slots * windows, ratio, dim, dtype=dtype, device=device) if overlap else None,
                   torch.zeros(slots * windows, ratio, dim, dtype=torch.float32, device=device) if overlap else None)

    @property
    def ring(self) -> int:
        """Rows of projected rows per sequence slot."""
        return self.windows * self.ratio

    def row(self, slot, position):
        """The row of a slot's position (ints or tensors alike)."""
        return slot * self.ring + position % self.ring

    def prev(self, slot, window):
        """The row of prev_kv / prev_gate keeping complete window `window`'s first series."""
        return slot * self.windows + window % self.windows

    def tensors(self) -> list[torch.Tensor]:
        return [*self.entries.tensors(), *(t for t in (self.kv, self.gate, self.prev_kv, self.prev_gate)
                                           if t is not None)]

    def start(self, slot: int) -> None:
        """A sequence starts in `slot`: no window before its first (its unfinished rows are written before read)."""
        if self.overlap:
            self.prev_gate[slot * self.windows:(slot + 1) * self.windows] = float("-inf")

    def copy_slot(self, source: int, target: int) -> None:
        r, w = self.ring, self.windows
        self.kv[target * r:(target + 1) * r] = self.kv[source * r:(source + 1) * r]
        self.gate[target * r:(target + 1) * r] = self.gate[source * r:(source + 1) * r]
        if self.overlap:
            self.prev_kv[target * w:(target + 1) * w] = self.prev_kv[source * w:(source + 1) * w]
            self.prev_gate[target * w:(target + 1) * w] = self.prev_gate[source * w:(source + 1) * w]


def speculative_windows(ratio: int, speculative_tokens: int) -> int:
    """Windows a compressor's slot keeps (CompressorPool) when steps may rewind over up to `speculative_tokens`
    rejected drafts: a step's rows, the rejected ones included, reach at most speculative_tokens - 1 positions past
    the next step's first, so they stay within the window after the rewound one's while speculative_tokens <=
    ratio, and only the last complete window is one a rewound step pools again."""
    if not speculative_tokens:
        return 1
    if speculative_tokens > ratio:
        raise InputError(f"--speculative-config num_speculative_tokens {speculative_tokens} exceeds deepseek_v4's "
                         f"compress ratio {ratio}: rejected drafts could complete two windows")
    return 2


@dataclass
class CompressorState:
    """One compressor's rows in the state blocks: the last `kept` positions of each block (`state_rows`), position
    p of state block b at row b * kept + p % block_size - (block_size - kept); `width` of the projected rows: both
    series, or the first one (an overlapping compressor whose windows fit in a block)."""
    kept: int
    width: int
    kv: torch.Tensor  # [state_blocks * kept, width]
    gate: torch.Tensor  # [state_blocks * kept, width] float32

    def tensors(self) -> list[torch.Tensor]:
        return [self.kv, self.gate]


@dataclass
class LayerState:
    """One layer's part of the state blocks (prefix caching): its window keys, position p of state block b at row
    b * block_size + p % block_size, and each compressor's rows (None: it keeps none)."""
    block_size: int
    window: Rows
    compressors: list[CompressorState | None]

    def tensors(self) -> list[torch.Tensor]:
        return [*self.window.tensors(), *(t for c in self.compressors if c is not None for t in c.tensors())]


@dataclass
class LayerPool:
    window: Rows  # slots * window_rows rows: slot s, position p at row s * window_rows + p % window_rows
    window_rows: int  # per slot: sliding_window, plus the drafts a speculative step may rewind over
    compressor: CompressorPool | None  # CSA and HCA layers
    indexer: CompressorPool | None  # CSA layers: the indexer's own compressed keys
    state: LayerState | None = None  # with prefix caching: the state blocks' rows of this layer

    def compressors(self) -> list[CompressorPool]:
        return [c for c in (self.compressor, self.indexer) if c is not None]

    def tensors(self) -> list[torch.Tensor]:
        return [*self.window.tensors(), *(t for c in self.compressors() for t in c.tensors()),
                *(self.state.tensors() if self.state is not None else ())]


class V4Cache(KVCache):
    def __init__(self, cfg: V4Config, capacity_tokens: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 block_size: int = DEFAULT_BLOCK_SIZE, max_seqs: int = DEFAULT_MAX_SEQS, kv_cache_dtype: str = "auto",
                 state_blocks: int = 0, speculative_tokens: int = 0, mtp: bool = False):
        """capacity_tokens: the tokens the paged groups hold (whole blocks); max_seqs: the sequence slots; entries,
        windows and state in `dtype` (the model's compute dtype; INT8 with kv_cache_dtype int8, but the unfinished
        windows), gates in float32; state_blocks: the state blocks prefix caching keeps (0: no prefix caching);
        speculative_tokens: the drafts a step verifies, which it may rewind over (`advance`); mtp: one more layer,
        after the decoder layers', for the MTP layer (deepseek_v4.MultiTokenPredictor).

        A step of speculative decoding writes its rejected drafts' rows too. A window row is written over by the
        position sliding_window later, so the slot's window keeps sliding_window + speculative_tokens rows: a
        rejected row then never replaces one the rewound step still sees; the compressors keep two windows
        (`speculative_windows`). Rejected rows themselves are written over by the next step, which writes the
        same positions before it reads them; the entries they complete live in blocks past the accepted tokens,
        which no prefix hit reads before they are written again."""
        layer_ratios = cfg.compress_ratios[:cfg.num_hidden_layers + mtp]
        check_geometry(layer_ratios, block_size)
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        fields = cache_fields(cfg, kv_cache_dtype)
        self.block_size, self.max_seqs = block_size, max_seqs
        self.num_blocks = cache_blocks(capacity_tokens, block_size)
        self.window = cfg.sliding_window
        self.window_rows = cfg.sliding_window + speculative_tokens
        self.speculative_tokens = speculative_tokens
        # on an accelerator an idle rank's throwaway token writes into one block past the pool's, which no sequence
        # is ever given, and takes a slot of its own (one more than max_seqs: the idle rank runs nothing else)
        npu = takes_npu_path(self.device)
        self.dummy_block = self.num_blocks if npu else None
        blocks, slots = self.num_blocks + npu, max_seqs + npu
        self.layers: list[LayerPool] = []
        for ratio in layer_ratios:
            attn_type, compressor, indexer = attn_type_of(ratio), None, None
            if attn_type is not AttnType.SLIDING:
                compressor = CompressorPool.allocate(ratio, fields["kv"], attn_type is AttnType.CSA, blocks,
                                                     block_size, slots, dtype, self.device,
                                                     speculative_windows(ratio, speculative_tokens))
            if attn_type is AttnType.CSA:
                csa = cfg.csa_compress_rate
                indexer = CompressorPool.allocate(csa, fields["index_k"], True, blocks, block_size, slots, dtype,
                                                  self.device, speculative_windows(csa, speculative_tokens))
            window = Rows(slots * self.window_rows, fields["kv"], dtype, self.device)
            layer = LayerPool(window, self.window_rows, compressor, indexer)
            if state_blocks:
                layer.state = LayerState(block_size, Rows(state_blocks * block_size, fields["kv"], dtype, self.device),
                                         [self._compressor_state(c, state_blocks) for c in layer.compressors()])
            self.layers.append(layer)
        self.state_blocks = state_blocks
        self.free_slots = list(range(slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.slots: dict[int, int] = {}  # seq_id -> its sequence slot
        self.lengths: dict[int, int] = {}  # seq_id -> tokens it has taken in

    def _compressor_state(self, c: CompressorPool, blocks: int) -> CompressorState | None:
        kept = state_rows(c.ratio, c.overlap, self.block_size)
        if not kept:
            return None
        width = c.kv.shape[1] if c.ratio > self.block_size else c.kv.shape[1] // 2
        return CompressorState(kept, width, torch.zeros(blocks * kept, width, dtype=c.kv.dtype, device=self.device),
                               torch.zeros(blocks * kept, width, dtype=torch.float32, device=self.device))

    def state_kept(self) -> list[int]:
        """The counts of each block's last positions the state groups keep (block_size for the windows)."""
        if not self.state_blocks:
            return []
        return sorted({self.block_size} | {c.kept for layer in self.layers for c in layer.state.compressors
                                            if c is not None})

    @property
    def prefix_caching(self) -> bool:
        """Whether a sequence may start from published blocks: it needs the state blocks to restore its slot."""
        return self.state_blocks > 0

    def state_start(self, length: int) -> int:
        """The first position whose state a sequence starting at block boundary `length` restores."""
        return max(0, length - state_reach(self.cfg, self.block_size))

    # -- sizes ---------------------------------------------------------------------------------------------------

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the cache: its only storage."""
        return [t for layer in self.layers for t in layer.tensors()]

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes in every paged group and layer, from the tensors themselves."""
        return sum(c.entries.row_bytes * entry_slots(c.ratio, self.block_size)
                   for layer in self.layers for c in layer.compressors())

    @property
    def bytes_per_seq(self) -> int:
        """Bytes one sequence slot takes: every layer's window and compressor state."""
        per_slot = 0
        for layer in self.layers:
            per_slot += layer.window.row_bytes * self.window_rows
            for c in layer.compressors():
                per_slot += c.kv[:c.ring].nbytes + c.gate[:c.ring].nbytes
                per_slot += c.prev_kv[:c.windows].nbytes + c.prev_gate[:c.windows].nbytes if c.overlap else 0
        return per_slot

    @property
    def bytes_per_state_block(self) -> int:
        """Bytes one state block takes over every layer (0 without prefix caching)."""
        return sum(t.nbytes for layer in self.layers if layer.state is not None
                   for t in layer.state.tensors()) // max(1, self.state_blocks)

    def ratios(self) -> list[int]:
        """The paged groups' ratios, each once (the indexer's keys share the CSA entries' geometry)."""
        return sorted({c.ratio for layer in self.layers for c in layer.compressors()})

    # -- the KVCache protocol ------------------------------------------------------------------------------------

    def advance(self, seq_id: int, start: int, stop: int) -> None:
        """The sequence's positions start .. stop - 1 come this step: a new sequence (start 0) takes a slot; a running
        one must continue where it stopped (no gap), or with speculative decoding up to speculative_tokens
        positions before, over the rejected drafts of its last step (or the MTP layer's chained passes)."""
        held = self.lengths.get(seq_id, 0)
        if not held - self.speculative_tokens <= start <= held:
            raise ValueError(f"invalid step batch: sequence {seq_id} continues at position {start}, its cache holds "
                             f"{held} tokens" + (f" (a step may rewind over at most {self.speculative_tokens})"
                                                 if self.speculative_tokens else ""))
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
        rows = torch.arange(self.window_rows, device=self.device)
        if fork.copies:  # no zero-size tensor when no partial block is copied
            parent_blocks = torch.tensor([p for p, _ in fork.copies], dtype=torch.long, device=self.device)
            child_blocks = torch.tensor([c for _, c in fork.copies], dtype=torch.long, device=self.device)
        for layer in self.layers:
            layer.window.copy(source * self.window_rows + rows, slot * self.window_rows + rows)
            for c in layer.compressors():
                c.copy_slot(source, slot)
                if fork.copies:
                    per_block = entry_slots(c.ratio, self.block_size)
                    offsets = torch.arange(per_block, device=self.device)
                    c.entries.copy((parent_blocks[:, None] * per_block + offsets).flatten(),
                                   (child_blocks[:, None] * per_block + offsets).flatten())
        self.slots[fork.child], self.lengths[fork.child] = slot, self.lengths[fork.parent]

    def restore(self, restore: Restore) -> None:
        """A new sequence starting at block boundary `restore.length` from published blocks: a slot of its own,
        filled from the state blocks of the positions before it (`state_start` ..), as a sequence that had
        computed those positions would have it."""
        seq_id, length, block_size = restore.seq_id, restore.length, self.block_size
        if seq_id in self.slots or length % block_size:
            raise ValueError(f"invalid step batch: sequence {seq_id} restored at {length} (a running sequence, or "
                             f"not a block boundary)")
        state = dict(restore.blocks)
        missing = sorted({p // block_size for p in range(self.state_start(length), length)} - state.keys())
        if missing:
            raise ValueError(f"invalid step batch: sequence {seq_id} restored at {length} lacks the state blocks "
                             f"of blocks {missing}")
        slot = self._take_slot(seq_id)

        def rows(positions: range, kept: int = block_size) -> torch.Tensor:
            """The state rows of these positions, in a group keeping each block's last `kept`."""
            return torch.tensor([state[p // block_size] * kept + p % block_size - (block_size - kept)
                                 for p in positions], dtype=torch.long, device=self.device)

        window = range(max(0, length - self.window + 1), length)
        for layer in self.layers:
            if window:
                target = torch.tensor([slot * self.window_rows + p % self.window_rows for p in window],
                                      device=self.device)
                layer.state.window.copy(rows(window), target, into=layer.window)
            for c, kept in zip(layer.compressors(), layer.state.compressors, strict=True):
                base = length // c.ratio * c.ratio  # the unfinished window's first position
                if base < length:  # only a ratio above the block size leaves one at a block boundary
                    ring = c.row(slot, torch.arange(base, length, device=self.device))
                    c.kv.index_copy_(0, ring, kept.kv.index_select(0, rows(range(base, length))))
                    c.gate.index_copy_(0, ring, kept.gate.index_select(0, rows(range(base, length))))
                if c.overlap and base:  # the last complete window's first series
                    source = rows(range(base - c.ratio, base), kept.kept)
                    prev = c.prev(slot, base // c.ratio - 1)
                    c.prev_kv[prev] = kept.kv.index_select(0, source)[:, :c.prev_kv.shape[2]]
                    c.prev_gate[prev] = kept.gate.index_select(0, source)[:, :c.prev_gate.shape[2]]
        self.slots[seq_id], self.lengths[seq_id] = slot, length

    def transfer_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(block views, state views) as LatentCache.transfer_views: a unit of a block view is one block's entries of
        one compressed group's tensor, a unit of a state view one state block's rows of one state tensor (none
        without prefix caching). A sequence's slot (window, unfinished windows) is not among them: a prefix hit
        rebuilds it from state blocks (`restore`)."""
        blocks, state = [], []
        for layer in self.layers:
            for c in layer.compressors():
                blocks += [block_view(t, entry_slots(c.ratio, self.block_size)) for t in c.entries.tensors()]
            if layer.state is not None:
                state += [block_view(t, self.block_size) for t in layer.state.window.tensors()]
                state += [block_view(t, c.kept) for c in layer.state.compressors if c is not None for t in c.tensors()]
        return blocks, state

    def release(self, seq_id: int) -> None:
        """A finished (or preempted) sequence's slot is free again; its blocks are the pool's to reuse."""
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        self.lengths.pop(seq_id, None)
