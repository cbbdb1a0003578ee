"""One step's metadata as the model's forward reads it (vLLM's vocabulary: slots, block tables, query and context
lengths), built from the step's Batch in one place, the worker's InputBuilder (runner/engine/worker.py), and the
helpers the models use on a step's rows.

For V3's latent cache (runner/models/kv_cache.py, LatentCache) a sequence's token at position p lives at slot
block_table[p // block_size] * block_size + p % block_size; `context_slots` lists the slots of its whole context.
DeepSeek-V4's cache (runner/models/v4_cache.py) takes its own part of the step, `V4Step`: per cache group the
entry slots its block tables give, the sequence slots, the window rows and the windows that complete.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

# The most context rows (padded) one batched decode call gathers: a step's one-token sequences are split into
# groups under it, so the gather stays bounded however long contexts grow. 65536 rows of V3's latent (576
# values) are 151 MB in float32, 75 MB in BF16; V3.2's indexer keys (128 values) a quarter of that. A sequence
# whose context alone is longer gets a group of its own, which gathers its context as a loop over sequences would.
DECODE_GATHER_ROWS = 65536
# The most attention or index scores (query rows x heads x context positions) a prefill chunk holds at once: its
# queries are taken this many scores at a time, so a long prompt's scores stay bounded as the gather above does.
# 2**25 float32 scores are 128 MiB; the attention's softmax holds about two such tensors more. Measured before
# (scripts/real_dims.py): one 2,400-token V3.2 prompt (128 heads) peaked at 10 GB in its rank, the whole
# [heads, 2400, 2400] scores in float32 held twice.
PREFILL_SCORES = 2**25


def query_chunks(queries: int, scores_per_query: int) -> list[slice]:
    """Slices of a prefill chunk's queries, each holding at most PREFILL_SCORES scores (one query at least)."""
    per = max(1, PREFILL_SCORES // max(1, scores_per_query))
    return [slice(first, min(first + per, queries)) for first in range(0, queries, per)]


@dataclass(frozen=True)
class SeqStep:
    seq_id: int
    start: int  # this sequence's rows in the flattened step
    stop: int
    context_len: int  # tokens cached for the sequence once this step's tokens are written
    # the latent cache only (DeepSeek-V4's cache takes its own metadata, V4Step):
    context_slots: torch.Tensor | None = None  # [context_len] the cache slots of positions 0 .. context_len - 1
    causal: torch.Tensor | None = None  # [query_len, context_len] True where query i (position context_len -
    #                                     query_len + i) may look; None for one query, which sees everything, and
    #                                     for a chunk the decode groups take row by row (StepMeta.batched_rows)
    first_slot: int | None = None  # set when context_slots are first_slot .. first_slot + context_len - 1, i.e.
    #                                the block table is consecutive blocks: the context is then read as a view

    @property
    def query_len(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class DecodeRows:
    """A group of the step's one-token sequences (decodes), and of the rows of short chunks (speculative decoding's
    verifications, StepMeta.batched_rows) each as one over its context up to its own position, attended in one
    batched call: their contexts side by side, each padded to the longest. Gathering B padded contexts reads
    B * max_context entries where a loop over the sequences reads their sum (bounded by DECODE_GATHER_ROWS); it
    replaces a dozen calls per sequence and layer with a dozen per group and layer."""
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
    _: KW_ONLY  # the rest by name: a field added among them cannot take another's argument
    decodes: tuple[DecodeRows, ...] = ()  # paged caches: the one-token sequences (and short chunks' rows), in groups
    cp: CPStep | None = None  # a context-parallel prefill's share (then `seqs` is empty)
    v4: V4Step | None = None  # DeepSeek-V4's cache groups (then `slots`, `decodes` are unused)
    batched_rows: int = 1  # the latent cache's chunks this long or shorter are rows of `decodes`, each row alone


@dataclass(frozen=True)
class CPStep:
    """This rank's share of a context-parallel prefill (runner/engine/batch.py, CPShare): its rows are the
    positions `positions` of a `length`-token prompt. Each layer gathers the group's new cache entries (every
    member's rows, padded to `most`, member after member) and puts them in position order (`order`) into
    `scratch`, a one-layer cache of the whole prompt that this rank's queries attend over as `seq`; the owner
    also writes them into its own cache (`owner_meta`). A prompt whose first `start` positions were a prefix-cache
    hit has their entries on the owner only: it broadcasts them, as stored, to the scratch of every member."""
    positions: torch.Tensor  # [T] this rank's positions, ascending
    length: int
    most: int  # the most positions any member feeds
    order: torch.Tensor  # [length]: the gathered row of each position (the gather is in the members' rank order)
    # a one-layer kv_cache.LatentCache of the whole prompt (kv_cache.py imports this module, so it is not named here)
    scratch: object
    scratch_meta: StepMeta  # writes positions 0 .. length - 1 to the scratch
    seq: SeqStep  # this rank's queries over the scratch (causal by position)
    owner_meta: StepMeta | None  # the owner's: writes the new entries to its cache
    start: int = 0  # positions before it are cached on the owner (a prefix hit), sent to the others in each layer
    owner: int = 0  # the owner's rank (context parallelism runs at attention TP 1: its DP index)
    prefix_slots: torch.Tensor | None = None  # the owner's: the cache slots of positions 0 .. start - 1


@dataclass(frozen=True)
class V4Entries:
    """One paged group (compress ratio r) for a decode group's B rows, once each one's token is in."""
    slots: torch.Tensor | None  # [B, n_max] slots of each row's entries 0 .. n_i - 1 (n_i = (position + 1) // r),
    #                             padded; None when no row has an entry yet
    valid: torch.Tensor | None  # [B, n_max] True at a real entry; None when none is padded
    pool_rows: torch.Tensor | None  # [k] the group's rows (0 .. B - 1) whose token completes a window; None: none
    pool_slots: torch.Tensor | None  # [k] where their new entries go
    pool_index: torch.Tensor | None  # [k] those entries' numbers

    @property
    def most(self) -> int:
        return 0 if self.slots is None else self.slots.shape[1]


@dataclass(frozen=True)
class V4Decode:
    """A group of the step's rows attended in one batched call, each as a one-token sequence's: the one-token
    sequences', and the rows of short chunks (speculative decoding's verifications, v4_inputs.V4Inputs.batched_rows),
    each of which sees its sequence up to its own position."""
    rows: torch.Tensor  # [B] their rows in the step
    positions: torch.Tensor  # [B] their tokens' positions
    state: torch.Tensor  # [B] their sequences' slots (a short chunk's rows share one)
    window: torch.Tensor  # [B, sliding_window] window rows of positions p - window + 1 .. p (ring rows)
    window_valid: torch.Tensor  # [B, sliding_window] True where that position exists (>= 0)
    entries: dict[int, V4Entries]  # by ratio


@dataclass(frozen=True)
class V4Prefill:
    """One sequence's chunk of several rows (positions start .. seq.context_len - 1), longer than the short chunks
    the decode groups take (v4_inputs.V4Inputs.batched_rows)."""
    seq: SeqStep
    state: int  # its sequence slot
    entries: dict[int, torch.Tensor | None]  # ratio -> [context // ratio] slots of its entries once the chunk is in
    #                                          (None: none yet)


@dataclass(frozen=True)
class V4StateWrites:
    """Prefix caching: the step's rows whose state goes into state blocks (v4_cache.py), by the positions of a block
    a group keeps (its last `kept`; block_size for the window and the compressors whose windows span blocks) ->
    (the rows [k] in the step, their rows [k] in that group's state storage)."""
    by_kept: dict[int, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class V4Step:
    prefills: tuple[V4Prefill, ...]
    decodes: tuple[V4Decode, ...]
    state: V4StateWrites | None = None  # None: no row's state is kept this step


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


def range_start(ints: list[int]) -> int | None:
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
