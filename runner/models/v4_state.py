"""DeepSeek-V4's decode state, per request and layer: what attention needs from earlier steps. It grows by
one compressed entry per `ratio` tokens (CSA: history / 4, HCA: history / 128, plus the indexer's keys); the
rest is fixed in size (the window, the unfinished windows).

- `window`: the last `sliding_window` keys (= values, already rotated) [<= window, head_dim]; older rows are
  dropped, no query can reach them.
- per compressor (the attention's on CSA and HCA layers, the indexer's on CSA layers):
  `entries` it has emitted [n, dim]; the projected rows and gates of the window still filling
  [< ratio, series * dim], which the next steps complete; and for the overlapping (CSA) compressors the last
  complete window's first series with its gates [ratio, dim], which the next entry pools.

The model (deepseek_v4.py) reads and advances this state; here it is only held, behind kv_cache.KVCache's protocol:
`advance` starts a new request's state (and checks a running one continues where it stopped), `fork` copies one,
`release` drops a finished request. Capacity is the scheduler's block pool's, in blocks of block_size tokens as for
the paged caches (the state grows with the tokens it holds); the slots the batch carries are not used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsconv.family.arch import DEFAULT_BLOCK_SIZE
from dsconv.family.deepseek_v4 import AttnType, V4Config, attn_type_of
from dsconv.kernels.device import takes_npu_path
from dsconv.runner.models.batch import Fork
from dsconv.runner.models.kv_cache import KVCache, cache_blocks
from dsconv.runner.models.step import rows_from


@dataclass
class CompressorState:
    buffer: torch.Tensor  # [capacity >= 1, dim] emitted entries (normalized and rotated) in the first `count` rows
    count: int
    kv: torch.Tensor  # [pending < ratio, series * dim] projected rows of the unfinished window
    gate: torch.Tensor  # [pending, series * dim] float32: their gates, slot bias `ape` added
    prev_kv: torch.Tensor | None  # [ratio, dim] overlap only: the last complete window's first series
    prev_gate: torch.Tensor | None  # [ratio, dim] float32; -inf before the first window (weight 0)

    @classmethod
    def empty(cls, ratio: int, dim: int, overlap: bool, dtype: torch.dtype, device: torch.device) -> CompressorState:
        width = (2 if overlap else 1) * dim
        return cls(buffer=torch.zeros(1, dim, dtype=dtype, device=device), count=0,
                   kv=torch.zeros(0, width, dtype=dtype, device=device),
                   gate=torch.zeros(0, width, dtype=torch.float32, device=device),
                   prev_kv=torch.zeros(ratio, dim, dtype=dtype, device=device) if overlap else None,
                   prev_gate=torch.full((ratio, dim), float("-inf"), device=device) if overlap else None)

    @property
    def entries(self) -> torch.Tensor:
        return self.buffer[:self.count]

    def copy(self) -> CompressorState:
        def own(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.clone()

        return CompressorState(self.buffer[:max(self.count, 1)].clone(), self.count, rows_from(self.kv, 0),
                               rows_from(self.gate, 0), own(self.prev_kv), own(self.prev_gate))

    def append(self, new: torch.Tensor) -> torch.Tensor:
        """Adds entries [n, dim] -> every entry so far. The buffer doubles when full, so appending an entry
        every `ratio` tokens copies the history O(1) times amortized, not once per entry."""
        if self.count + new.shape[0] > self.buffer.shape[0]:
            grown = self.buffer.new_empty(max(2 * self.buffer.shape[0], self.count + new.shape[0]), new.shape[1])
            if self.count:
                grown[:self.count] = self.entries
            self.buffer = grown
        self.buffer[self.count:self.count + new.shape[0]] = new
        self.count += new.shape[0]
        return self.entries


@dataclass
class LayerState:
    window: torch.Tensor  # [<= sliding_window, head_dim]
    compressor: CompressorState | None  # CSA and HCA layers
    indexer: CompressorState | None  # CSA layers: the indexer's own compressed keys

    @classmethod
    def empty(cls, cfg: V4Config, ratio: int, dtype: torch.dtype, device: torch.device) -> LayerState:
        compressor = indexer = None
        attn_type = attn_type_of(ratio)
        if attn_type is not AttnType.SLIDING:
            compressor = CompressorState.empty(ratio, cfg.head_dim, attn_type is AttnType.CSA, dtype, device)
        if attn_type is AttnType.CSA:
            indexer = CompressorState.empty(cfg.csa_compress_rate, cfg.index_head_dim, True, dtype, device)
        return cls(torch.zeros(0, cfg.head_dim, dtype=dtype, device=device), compressor, indexer)

    def copy(self) -> LayerState:
        return LayerState(self.window.clone(), self.compressor and self.compressor.copy(),
                          self.indexer and self.indexer.copy())


class V4Cache(KVCache):
    paged = False  # a fork copies the whole state: the pool gives the copy blocks of its own

    def __init__(self, cfg: V4Config, capacity_tokens: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 block_size: int = DEFAULT_BLOCK_SIZE):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        # what the block pool accounts in, as for LatentCache; the state is per request, not paged
        self.block_size, self.num_blocks = block_size, cache_blocks(capacity_tokens, block_size)
        # on an accelerator an idle rank's throwaway token goes into a fresh state; its block (any) is only the
        # pool's count, the state holds no blocks
        self.dummy_block = 0 if takes_npu_path(self.device) else None
        self.lengths: dict[int, int] = {}  # seq_id -> tokens its state has taken in
        self.states: dict[int, list[LayerState]] = {}  # seq_id -> one state per layer

    def advance(self, seq_id: int, start: int, stop: int) -> None:
        """The sequence's positions start .. stop - 1 come this step: they continue its state (position by position:
        no gap, no rewind), which a new sequence gets empty."""
        if self.lengths.get(seq_id, 0) != start:
            raise ValueError(f"invalid step batch: sequence {seq_id} continues at position {start}, its state holds "
                             f"{self.lengths.get(seq_id, 0)} tokens")
        if seq_id not in self.states:
            self.states[seq_id] = [LayerState.empty(self.cfg, ratio, self.dtype, self.device)
                                   for ratio in self.cfg.compress_ratios[:self.cfg.num_hidden_layers]]
        self.lengths[seq_id] = stop

    def layer(self, seq_id: int, layer: int) -> LayerState:
        return self.states[seq_id][layer]

    def fork(self, fork: Fork) -> None:
        """A forked sequence continues from a copy of its parent's state (the blocks are only the pool's count)."""
        self.states[fork.child] = [state.copy() for state in self.states[fork.parent]]
        self.lengths[fork.child] = self.lengths[fork.parent]

    def release(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)
        self.lengths.pop(seq_id, None)

