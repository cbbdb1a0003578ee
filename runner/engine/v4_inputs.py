"""DeepSeek-V4's part of a step's metadata (step.V4Step), built by the worker's InputBuilder from the step's Batch:
the contract the V4-Flash design asks of a serving layer, as tensors.

- block tables per cache group: each paged group's entry slots (v4_cache.entry_slot), per prefill sequence
  [n] and per decode group [B, n_max] with its validity (padded entries are the invalid ones);
- write slots: the entries that decode rows complete (their rows, slots and numbers), and each row's sequence slot
  (window and unfinished-window rows at position mod window / ratio);
- sliding-window indices: each decode row's window rows, with the positions before 0 marked invalid;
- query_start_loc and context lengths: each sequence's SeqStep;
- with prefix caching, the state rows each row's window key and compressor rows are also written to
  (V4StateWrites, from the batch's state blocks).
The compressed top-k indices (and their invalid marker) are the indexer's choice inside the step
(deepseek_v4.Indexer.select_decode), over these entry slots.

It keeps, per running sequence, the slots of its entries so far (extended as windows complete), so a decode step
does not read the whole block table again, as InputBuilder does for the latent cache's context slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from dsconv.runner.engine.batch import Batch
from dsconv.runner.models.step import (SeqStep, V4Decode, V4Entries, V4Prefill, V4StateWrites, V4Step, gather_groups,
                                       lengths_mask)
from dsconv.runner.models.v4_cache import V4Cache, entry_slot


class V4Inputs:
    def __init__(self, cache: V4Cache):
        self.cache, self.device = cache, cache.device
        self.ratios = cache.ratios()
        # the longest chunk whose rows attend as decode rows: each row's keys are read once all the chunk's rows are
        # written, so its window's oldest keys must outlive the chunk's writes (the slot keeps sliding_window +
        # speculative_tokens rows: a verification's k + 1 rows fit), and a chunk completes at most one window of
        # each compressor, which a decode group pools once (no longer than the smallest ratio)
        self.batched_rows = min([cache.speculative_tokens + 1, *self.ratios])
        self.known: dict[int, dict[int, torch.Tensor]] = {}  # seq_id -> ratio -> slots of its entries so far

    def release(self, seq_id: int) -> None:
        self.known.pop(seq_id, None)

    def __call__(self, batch: Batch, seqs: list[SeqStep]) -> V4Step:
        """The step's V4 metadata, for its sequences (whose positions the cache has advanced), checked. One-row
        sequences, and the short chunks of speculative decoding (`batched_rows`), attend as rows of the decode
        groups; longer chunks one sequence at a time."""
        prefills, rows = [], []
        for i, seq in enumerate(seqs):
            entries = {r: self._entries(seq, batch.block_tables[i], r) for r in self.ratios}
            if 0 < seq.query_len <= self.batched_rows:
                first, state = seq.context_len - seq.query_len, self.cache.slots[seq.seq_id]
                rows += [DecodeRow(seq.start + j, first + j, state, entries) for j in range(seq.query_len)]
            elif seq.query_len:
                prefills.append(V4Prefill(seq, self.cache.slots[seq.seq_id], entries))
        smallest = self.ratios[0] if self.ratios else None  # the group with the most entries bounds the gather
        # groups keep step order: a sequence's rows split over two groups are written by the earlier before the
        # later reads them
        groups = gather_groups([0 if smallest is None else (row.position + 1) // smallest for row in rows])
        return V4Step(tuple(prefills), tuple(self._decode([rows[i] for i in group]) for group in groups),
                      self._state_writes(batch, seqs))

    def _state_writes(self, batch: Batch, seqs: list[SeqStep]) -> V4StateWrites | None:
        """Where the step's rows' state goes: each position of a block with a state block, in every group that
        keeps that position of its block (the last `kept` of block_size)."""
        cache, block_size = self.cache, self.cache.block_size
        kept_counts = cache.state_kept()
        found: dict[int, tuple[list[int], list[int]]] = {kept: ([], []) for kept in kept_counts}
        for seq, pairs in zip(seqs, batch.state_blocks, strict=True):
            if not pairs:
                continue
            state = dict(pairs)
            if not all(0 <= block < cache.state_blocks for block in state.values()):
                raise ValueError(f"invalid step batch: sequence {seq.seq_id} writes a state block outside "
                                 f"0..{cache.state_blocks - 1}")
            first = seq.context_len - seq.query_len
            for position in range(first, seq.context_len):
                block = state.get(position // block_size)
                if block is None:
                    continue
                for kept in kept_counts:
                    offset = position % block_size - (block_size - kept)
                    if offset >= 0:
                        found[kept][0].append(seq.start + position - first)
                        found[kept][1].append(block * kept + offset)
        if not any(rows for rows, _ in found.values()):
            return None
        device = self.device
        return V4StateWrites({kept: (torch.tensor(rows, dtype=torch.long, device=device),
                                     torch.tensor(slots, dtype=torch.long, device=device))
                              for kept, (rows, slots) in found.items() if rows})

    def _entries(self, seq: SeqStep, table: list[int], ratio: int) -> torch.Tensor | None:
        """The slots of the sequence's entries 0 .. context // ratio - 1 of a ratio's groups: what it had, extended
        by the windows this step completes (a sequence new here, a forked sample too, reads its block table)."""
        count = seq.context_len // ratio
        known = self.known.setdefault(seq.seq_id, {}).get(ratio)
        have = 0 if known is None else known.shape[0]
        new_start = seq.context_len - seq.query_len
        if known is not None and have < new_start // ratio:
            raise ValueError(f"invalid step batch: sequence {seq.seq_id} has {have} entries of ratio {ratio} "
                             f"cached, its step (positions {new_start} .. {seq.context_len - 1}) needs "
                             f"{new_start // ratio} before it")
        if have > new_start // ratio:  # a rewound step (the cache checked it): its rejected drafts' entries go
            have = new_start // ratio
            known = known[:have] if have else None
            self.known[seq.seq_id][ratio] = known
        if have < count:
            block_size = self.cache.block_size
            new = torch.tensor([entry_slot(table, e, ratio, block_size) for e in range(have, count)],
                               dtype=torch.long, device=self.device)
            known = new if known is None else torch.cat([known, new])
            self.known[seq.seq_id][ratio] = known
        return known  # None: no entry yet (no zero-size tensor reaches a device kernel)

    def _decode(self, rows: list[DecodeRow]) -> V4Decode:
        device, window = self.device, self.cache.window
        positions = torch.tensor([row.position for row in rows], dtype=torch.long, device=device)
        state = torch.tensor([row.state for row in rows], dtype=torch.long, device=device)
        seen = positions[:, None] - window + 1 + torch.arange(window, device=device)  # [B, window] in position order
        entries = {}
        for ratio in self.ratios:
            counts = [(row.position + 1) // ratio for row in rows]  # the entries complete once the row is in
            if not max(counts):
                entries[ratio] = V4Entries(None, None, None, None, None)
                continue
            # [B, n_max], padded with slot 0
            slots = pad_sequence([row.entries[ratio][:count] if count else torch.zeros(1, dtype=torch.long,
                                                                                          device=device)
                                  for row, count in zip(rows, counts, strict=True)], batch_first=True)
            pooled = [j for j, row in enumerate(rows) if (row.position + 1) % ratio == 0]  # their row completes
            pool_rows = pool_slots = pool_index = None
            if pooled:
                pool_rows = torch.tensor(pooled, dtype=torch.long, device=device)
                pool_index = torch.tensor([counts[j] - 1 for j in pooled], dtype=torch.long, device=device)
                pool_slots = slots[pool_rows, pool_index]
            valid = lengths_mask(counts, device) if min(counts) < max(counts) else None
            entries[ratio] = V4Entries(slots, valid, pool_rows, pool_slots, pool_index)
        ring = self.cache.window_rows
        step_rows = torch.tensor([row.row for row in rows], dtype=torch.long, device=device)
        return V4Decode(step_rows, positions, state, state[:, None] * ring + seen % ring, seen >= 0, entries)


@dataclass(frozen=True)
class DecodeRow:
    """One row of a decode group: a one-row sequence's, or one of a short chunk's (`V4Inputs.batched_rows`)."""
    row: int  # in the step
    position: int
    state: int  # its sequence slot
    entries: dict[int, torch.Tensor | None]  # ratio -> the slots of the sequence's entries once the step is in
