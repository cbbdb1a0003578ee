"""DeepSeek-V4's decode state, per request and layer: what attention needs from earlier steps. It grows by
one compressed entry per `ratio` tokens (CSA: history / 4, HCA: history / 128, plus the indexer's keys); the
rest is fixed in size (the window, the unfinished windows).

- `window`: the last `sliding_window` keys (= values, already rotated) [<= window, head_dim]; older rows are
  dropped, no query can reach them.
- per compressor (the attention's on CSA and HCA layers, the indexer's on CSA layers):
  `entries` it has emitted [n, dim]; the projected rows and gates of the window still filling
  [< ratio, series * dim], which the next steps complete; and for the overlapping (CSA) compressors the last
  complete window's first series with its gates [ratio, dim], which the next entry pools.

`model_v4` reads and advances this state; here it is only held. The step protocol is LatentCache's: `step`
reserves the new tokens and returns the step's metadata, `release` drops a finished request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsconv.family.deepseek_v4 import AttnType, V4Config, attn_type_of
from dsconv.runner.models.batch import Batch
from dsconv.runner.models.kv_cache import BLOCK_SIZE, SeqStep, StepMeta, cache_full, concat


@dataclass
class CompressorState:
    buffer: torch.Tensor  # [capacity, dim] emitted entries (normalized and rotated) in the first `count` rows
    count: int
    kv: torch.Tensor  # [pending < ratio, series * dim] projected rows of the unfinished window
    gate: torch.Tensor  # [pending, series * dim] float32: their gates, slot bias `ape` added
    prev_kv: torch.Tensor | None  # [ratio, dim] overlap only: the last complete window's first series
    prev_gate: torch.Tensor | None  # [ratio, dim] float32; -inf before the first window (weight 0)

    @classmethod
    def empty(cls, ratio: int, dim: int, overlap: bool, dtype: torch.dtype, device: torch.device) -> CompressorState:
        width = (2 if overlap else 1) * dim
        return cls(buffer=torch.zeros(0, dim, dtype=dtype, device=device), count=0,
                   kv=torch.zeros(0, width, dtype=dtype, device=device),
                   gate=torch.zeros(0, width, dtype=torch.float32, device=device),
                   prev_kv=torch.zeros(ratio, dim, dtype=dtype, device=device) if overlap else None,
                   prev_gate=torch.full((ratio, dim), float("-inf"), device=device) if overlap else None)

    @property
    def entries(self) -> torch.Tensor:
        return self.buffer[:self.count]

    def append(self, new: torch.Tensor) -> torch.Tensor:
        """Adds entries [n, dim] -> every entry so far. The buffer doubles when full, so appending an entry
        every `ratio` tokens copies the history O(1) times amortized, not once per entry."""
        if self.count + new.shape[0] > self.buffer.shape[0]:
            grown = self.buffer.new_empty(max(2 * self.buffer.shape[0], self.count + new.shape[0]), new.shape[1])
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


class V4Cache:
    def __init__(self, cfg: V4Config, capacity_tokens: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.cfg, self.capacity_tokens, self.dtype, self.device = cfg, capacity_tokens, dtype, torch.device(device)
        self.lengths: dict[int, int] = {}
        self.states: dict[int, list[LayerState]] = {}  # seq_id -> one state per layer

    # A scheduler accounts for this cache in blocks of BLOCK_SIZE tokens, as for the paged caches; the slots it
    # hands out are not used (the state is per request).
    block_size = BLOCK_SIZE

    @property
    def num_blocks(self) -> int:
        return self.capacity_tokens // BLOCK_SIZE

    def step(self, new_tokens: list[tuple[int, int]]) -> StepMeta:
        """Reserve (seq_id, n_new) tokens, in order -> the step's metadata (a scoring or test loop without a
        scheduler)."""
        seqs, positions, row = [], [], 0
        for seq_id, n_new in new_tokens:
            start = self.lengths.get(seq_id, 0)
            if sum(self.lengths.values()) + n_new > self.capacity_tokens:
                raise cache_full(self.capacity_tokens, seq_id, start + n_new)
            self._ensure_state(seq_id)
            self.lengths[seq_id] = start + n_new
            seqs.append(SeqStep(seq_id, row, row + n_new, start + n_new))
            positions.append(torch.arange(start, start + n_new, device=self.device))
            row += n_new
        flat = concat(positions, self.device)
        return StepMeta(seqs, flat, flat)

    def _ensure_state(self, seq_id: int) -> None:
        if seq_id not in self.states:
            self.states[seq_id] = [LayerState.empty(self.cfg, ratio, self.dtype, self.device)
                                    for ratio in self.cfg.compress_ratios[:self.cfg.num_hidden_layers]]

    def begin(self, batch: Batch) -> StepMeta:
        """The step's metadata (a sequence's slots are its positions: V4 keeps no paged token cache)."""
        seqs, positions = [], []
        for i, seq_id in enumerate(batch.seq_ids):
            row, stop, context = batch.span(i)
            self._ensure_state(seq_id)
            self.lengths[seq_id] = context
            seqs.append(SeqStep(seq_id, row, stop, context))
            positions.append(torch.arange(context - (stop - row), context, device=self.device))
        flat = concat(positions, self.device)
        return StepMeta(seqs, flat, flat)

    def layer(self, seq_id: int, layer: int) -> LayerState:
        return self.states[seq_id][layer]

    def release(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)
        self.lengths.pop(seq_id, None)
