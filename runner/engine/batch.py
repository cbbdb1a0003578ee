"""The scheduler-to-worker message: one step's work for one attention-DP rank, token-major (vLLM's vocabulary):
the scheduler on rank 0 builds it, every rank of that DP index receives it, and both sides validate it.

Sequence i feeds input_ids[query_start_loc[i]:query_start_loc[i + 1]], the tokens at positions
context_lens[i] - query_len .. context_lens[i] - 1; their cache entries go to slot_mapping's slots, which its
block table gives (slot = block_tables[i][p // block_size] * block_size + p % block_size). The tables come
from the scheduler's block pool (runner/engine/block_pool.py), the only allocator (DeepSeek-V4's cache reads
the tables, not the slot mapping: its entries are one per `ratio` tokens, runner/models/v4_cache.py).

A sample forked from another (n > 1) starts from a copy of that sequence's cache: `forks` names the pairs and the
blocks whose contents to copy (the full blocks of their common prompt are shared, in both block tables; nobody
writes them again). The ranks apply the forks before the releases, so a parent that finished in the step that
forked it can still be copied from.

Prefix caching on DeepSeek-V4 (runner/models/v4_cache.py): `state_blocks` names, per sequence, the state blocks its
step writes its tokens' rows into (block index in its sequence -> state block), and `restores` the sequences that
start from published blocks with their slot filled from published state blocks, applied after the releases."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dsconv.runner.models.kv_cache import Fork, Restore

if TYPE_CHECKING:
    from dsconv.runner.engine.kv_connector.base import StepMeta

# An idle attention-DP rank on an accelerator runs a throwaway one-token sequence in each step instead of zero rows
# (runner/engine/worker.py, InputBuilder), as vllm-ascend's idle ranks run a dummy batch: no device kernel sees
# a zero-size tensor there. Its id is no request's (the scheduler numbers sequences from 0), its token any id of
# the vocabulary.
DUMMY_SEQ_ID = -1
DUMMY_TOKEN = 0


@dataclass(frozen=True)
class SampleSpec:
    """Draw the sequence's next token from its last row's logits."""
    temperature: float
    top_p: float
    top_k: int
    seed: int
    index: int  # the drawn token's position in the request's output: the draw depends on (seed, index) only
    logprobs: int | None  # also return the drawn token's logprob and this many top entries
    grammar: object = None  # engine.grammar.GrammarSpec the token must follow, or None
    output: tuple[int, ...] = ()  # with a grammar: the request's output so far (a matcher rebuilt replays it)
    siblings: tuple[int, ...] = ()  # seeds of further samples drawn from the same row at the same index (n > 1)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the row's logits before anything
    # speculative decoding (engine/speculative.py): the drafts the chunk's last len(drafts) tokens are, verified by
    # its last len(drafts) + 1 rows (sampler.verify); and how many drafts the MTP layer proposes for the next step
    drafts: tuple[int, ...] = ()
    propose: int = 0
    # vLLM's extensions, applied to the row before anything reads it (engine/sampler.py, `adjust`)
    repetition_penalty: float = 1.0
    seen: tuple[int, ...] = ()  # with a repetition penalty: the distinct tokens of the prompt and output so far
    banned: tuple[int, ...] = ()  # before min_tokens: EOS and the stop tokens, which may not be drawn yet
    min_p: float = 0.0


@dataclass(frozen=True)
class CPShare:
    """One DP rank's part of a context-parallel prefill: a prompt's tokens spread over a group of DP ranks, each
    feeding its positions (`cp_positions`) in one step; the group gives that step to it (no other sequences).
    The owner, group[0], keeps the whole prompt in its cache and draws the first token (the prompt's last
    position is always the owner's)."""
    seq_id: int  # the prompt's sequence, as its owner's cache knows it
    length: int  # the prompt's tokens, positions 0 .. length - 1, those from `start` on computed here
    group: tuple[int, ...]  # the DP indices that share it, the owner first
    member: int  # this rank's place in `group`
    block_table: tuple[int, ...] = ()  # the owner's: where the prompt's entries go (empty elsewhere)
    sample: SampleSpec | None = None  # the owner's: draw the first token from its last row
    scores: PromptScores | None = None  # score this member's rows (each position but the prompt's last)
    start: int = 0  # positions before it are in the owner's cache (a prefix-cache hit): only the rest is split

    @property
    def positions(self) -> list[int]:
        return self.positions_of(self.member)

    def positions_of(self, member: int) -> list[int]:
        """The positions a member feeds: the ones past the cached prefix, split as `cp_positions` says."""
        return [self.start + p for p in cp_positions(self.length - self.start, len(self.group), member)]

    @property
    def scored_positions(self) -> list[int]:
        """The positions whose rows predict a prompt token: all of this member's but the prompt's last."""
        return [p for p in self.positions if p < self.length - 1]


def cp_positions(length: int, size: int, member: int) -> list[int]:
    """The positions member i of a group of `size` feeds: the prompt cut into 2 * size chunks (as even as whole
    tokens allow), chunks i and 2 * size - 1 - i. Causal attention makes a late chunk's queries cost more than an
    early one's; pairing them gives every member about the same work. Member 0 holds the last position."""
    bounds = [j * length // (2 * size) for j in range(2 * size + 1)]
    late = 2 * size - 1 - member
    return list(range(bounds[member], bounds[member + 1])) + list(range(bounds[late], bounds[late + 1]))


@dataclass(frozen=True)
class PromptScores:
    """Score prompt tokens: rows 0 .. len(targets) - 1 of the sequence's chunk predict `targets`."""
    targets: list[int]
    top: int  # top entries per row


@dataclass
class Batch:
    seq_ids: list[int] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)  # [T]
    query_start_loc: list[int] = field(default_factory=lambda: [0])  # [S + 1] cumulative query lengths
    context_lens: list[int] = field(default_factory=list)  # [S] tokens cached once this step's are written
    block_tables: list[list[int]] = field(default_factory=list)  # [S][blocks]
    slot_mapping: list[int] = field(default_factory=list)  # [T]
    samples: list[SampleSpec | None] = field(default_factory=list)  # [S]
    scores: list[PromptScores | None] = field(default_factory=list)  # [S]
    releases: list[int] = field(default_factory=list)  # sequences whose cache is freed before this step
    forks: list[Fork] = field(default_factory=list)  # sequences started from a copy of another's, before releases
    cp: CPShare | None = None  # this step is this rank's part of a context-parallel prefill (and nothing else)
    # [S]: (block index, state block) pairs whose state this step writes; empty without them (v4_cache.py)
    state_blocks: list[tuple[tuple[int, int], ...]] = field(default_factory=list)
    restores: list[Restore] = field(default_factory=list)  # sequences started from published state, after releases
    # [S] speculative decoding: the token after a sequence's chunk when it is known (a prompt fed in chunks), the
    # MTP layer's input at the chunk's last row; None where the step draws it
    follow: list[int | None] = field(default_factory=list)
    # the KV connector's work on this DP index's ranks before anything else of the step (engine/kv_connector/)
    kv: StepMeta | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def add(self, seq_id: int, tokens: list[int], context_len: int, block_table: list[int], block_size: int,
            sample: SampleSpec | None, scores: PromptScores | None,
            state_blocks: tuple[tuple[int, int], ...] = (), follow: int | None = None) -> None:
        self.seq_ids.append(seq_id)
        self.follow.append(follow)
        self.state_blocks.append(state_blocks)
        self.input_ids.extend(tokens)
        self.query_start_loc.append(self.query_start_loc[-1] + len(tokens))
        self.context_lens.append(context_len)
        self.block_tables.append(list(block_table))
        self.slot_mapping.extend(slots(block_table, block_size, context_len - len(tokens), context_len))
        self.samples.append(sample)
        self.scores.append(scores)

    def span(self, i: int) -> tuple[int, int, int]:
        """Sequence i's rows (start, stop) in the step and its context length once they are written."""
        return self.query_start_loc[i], self.query_start_loc[i + 1], self.context_lens[i]

    def for_sampler(self) -> Batch:
        """The batch as the sampler reads it: a context-parallel share as the one sequence of its rows."""
        if self.cp is None:
            return self
        view = Batch(seq_ids=[self.cp.seq_id], input_ids=self.input_ids, samples=[self.cp.sample],
                     scores=[self.cp.scores])
        view.query_start_loc.append(len(self.input_ids))
        return view

    def logit_rows(self) -> list[int]:
        """The rows whose logits this step needs, in order: each sequence's scored rows, then its last row
        when it samples."""
        if self.cp is not None:
            return self.for_sampler().logit_rows()
        rows = []
        for i in range(len(self.seq_ids)):
            start, stop = self.query_start_loc[i], self.query_start_loc[i + 1]
            if self.scores[i] is not None:
                rows.extend(range(start, start + len(self.scores[i].targets)))
            if self.samples[i] is not None:
                rows.extend(range(stop - 1 - len(self.samples[i].drafts), stop))
        return rows

    def validate(self, block_size: int, num_blocks: int) -> None:
        """Raises ValueError naming the first broken invariant (a scheduler bug, never a user's)."""
        if self.kv is not None:
            self.kv.validate(block_size, num_blocks)
        if self.cp is not None:
            self._validate_cp(block_size, num_blocks)
            return
        n = len(self.seq_ids)
        lengths = {"context_lens": self.context_lens, "block_tables": self.block_tables, "samples": self.samples,
                   "scores": self.scores, "state_blocks": self.state_blocks, "follow": self.follow}
        for name, values in lengths.items():
            _check(len(values) == n, f"{name} has {len(values)} entries for {n} sequences")
        _check(len(set(self.seq_ids)) == n, f"a sequence appears twice: {self.seq_ids}")
        _check(len(self.query_start_loc) == n + 1 and self.query_start_loc[0] == 0,
               f"query_start_loc {self.query_start_loc} does not start at 0 with one entry per sequence")
        _check(self.query_start_loc[-1] == len(self.input_ids) == len(self.slot_mapping),
               f"{self.query_start_loc[-1]} query tokens, {len(self.input_ids)} input ids, "
               f"{len(self.slot_mapping)} slots")
        holders: dict[int, set[int]] = {}
        for seq_id, table in zip(self.seq_ids, self.block_tables):
            for block in table:
                holders.setdefault(block, set()).add(seq_id)
        for fork in self.forks:
            _check(all(0 <= b < num_blocks for pair in fork.copies for b in pair),
                   f"fork of sequence {fork.parent} into {fork.child}: a block outside 0..{num_blocks - 1}")
        for i, seq_id in enumerate(self.seq_ids):
            start, stop, context = self.span(i)
            query = stop - start
            table = self.block_tables[i]
            _check(query >= 1, f"sequence {seq_id} feeds {query} tokens")
            _check(context >= query, f"sequence {seq_id}: context {context} < query {query}")
            _check(len(table) * block_size >= context, f"sequence {seq_id}: {len(table)} blocks for {context} tokens")
            _check(all(0 <= b < num_blocks for b in table), f"sequence {seq_id}: a block outside 0..{num_blocks - 1}")
            written = {slot // block_size for slot in self.slot_mapping[start:stop]}
            _check(all(holders[block] == {seq_id} for block in written if block in holders),
                   f"sequence {seq_id} writes a block another sequence holds")
            _check(self.slot_mapping[start:stop] == slots(table, block_size, context - query, context),
                   f"sequence {seq_id}: slot_mapping disagrees with its block table")
            first, last = (context - query) // block_size, (context - 1) // block_size
            _check(all(first <= index <= last for index, _ in self.state_blocks[i]),
                   f"sequence {seq_id} writes the state of a block outside its step's {first}..{last}")
            sample = self.samples[i]
            if sample is not None:
                _check(len(sample.drafts) < query and (not sample.drafts or self.scores[i] is None)
                       and self.follow[i] is None, f"sequence {seq_id} verifies {len(sample.drafts)} drafts in a "
                       f"chunk of {query} tokens (scored: {self.scores[i] is not None}, follow: {self.follow[i]})")
            scored = self.scores[i]
            if scored is not None:
                room = query - (1 if self.samples[i] is not None else 0)
                _check(len(scored.targets) <= room, f"sequence {seq_id}: {len(scored.targets)} scored rows of {query}")


        starts = {seq_id: context - (stop - start) for seq_id, (start, stop, context)
                  in zip(self.seq_ids, (self.span(i) for i in range(n)))}
        for restore in self.restores:
            _check(starts.get(restore.seq_id) == restore.length,
                   f"sequence {restore.seq_id} restored at {restore.length} does not continue there in this step")

    def _validate_cp(self, block_size: int, num_blocks: int) -> None:
        cp = self.cp
        _check(not self.seq_ids and self.query_start_loc == [0] and not self.slot_mapping,
               f"a context-parallel step carries other sequences: {self.seq_ids}")
        _check(0 <= cp.member < len(cp.group) and len(set(cp.group)) == len(cp.group),
               f"context-parallel member {cp.member} of group {cp.group}")
        _check(len(self.input_ids) == len(cp.positions), f"context-parallel member {cp.member} feeds "
               f"{len(self.input_ids)} tokens for {len(cp.positions)} positions")
        owner = cp.member == 0
        _check(owner == (len(cp.block_table) * block_size >= cp.length),
               f"context-parallel block table of {len(cp.block_table)} blocks on member {cp.member}")
        _check(all(0 <= b < num_blocks for b in cp.block_table), "a context-parallel block outside the cache")
        _check(owner or cp.sample is None, f"context-parallel member {cp.member} samples")
        _check(0 <= cp.start < cp.length and cp.start % block_size == 0 and (cp.scores is None or not cp.start),
               f"context-parallel prefill from position {cp.start} of {cp.length} (a cached prefix is whole blocks, "
               f"none for a scored prompt)")
        scored = cp.scores
        _check(scored is None or len(scored.targets) == len(cp.scored_positions),
               f"context-parallel member {cp.member} scores {len(scored.targets) if scored else 0} rows")


def slots(block_table: list[int], block_size: int, start: int, stop: int) -> list[int]:
    """The cache slots of positions start .. stop - 1."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, stop)]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"invalid step batch: {message}")


def dummy_batch(block: int, block_size: int) -> Batch:
    """The throwaway sequence's step: DUMMY_TOKEN at position 0, its entry in `block`, nothing sampled."""
    batch = Batch()
    batch.add(DUMMY_SEQ_ID, [DUMMY_TOKEN], 1, [block], block_size, None, None)
    return batch
