"""One rank's side of a step: the step's batch turned into the model's inputs (here only: `InputBuilder`), run
through the model, and its logits through the sampler.

The batch (runner/engine/batch.py) is what the scheduler decided, in lists; the inputs are tensors on the rank's
device: the token ids, the rows whose logits are needed, and the step's metadata (runner/models/step.py) that the
model's attention reads: each sequence's rows, positions and context, for the latent cache the slots of its context
and its causal mask, the decode sequences in groups, and a context-parallel prefill's share."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsconv.kernels.attention import causal_mask
from dsconv.runner.engine.grammar import Grammars
from dsconv.runner.engine.kv_connector.base import KVConnectorWorker
from dsconv.runner.engine.kv_connector.base import StepMeta as ConnectorMeta
from dsconv.runner.engine.request import SeqResult
from dsconv.runner.engine.sampler import constrain, drawn_results, plain_draws, step_results, verify
from dsconv.runner.engine.speculative import SpeculativeConfig
from dsconv.runner.engine.v4_inputs import V4Inputs
from dsconv.runner.engine.batch import DUMMY_SEQ_ID, Batch, CPShare, dummy_batch, slots
from dsconv.runner.models.dist import Dist
from dsconv.runner.models.draw import Draw
from dsconv.runner.models.eplb import ExpertBalancer
from dsconv.runner.models.kv_cache import KVCache
from dsconv.runner.models.step import (CPStep, DecodeRows, SeqStep, StepMeta, concat, gather_groups, lengths_mask,
                                       range_start)
from dsconv.runner.models.v4_cache import V4Cache


@dataclass(frozen=True)
class StepInputs:
    """What the model's forward takes for one step, besides the cache."""
    tokens: torch.Tensor  # [T] int64: the batch's input ids
    meta: StepMeta  # positions, slots, each sequence's context
    rows: torch.Tensor | None  # the rows whose logits the step needs (Batch.logit_rows); None: every row
    dummy: bool = False  # an idle rank's throwaway token (batch.DUMMY_SEQ_ID): its results are dropped


THROWAWAY_DRAW = Draw(temperature=0.0, top_k=0, seed=0, index=0)  # an idle rank's throwaway logits row


class InputBuilder:
    """Each step's model inputs from its batch, on the cache's device. It keeps, for the latent cache, the slots of
    each running sequence's context so far, so a decode step extends them by its new slots instead of reading
    the whole block table again."""

    def __init__(self, cache: KVCache, speculative_tokens: int = 0):
        """speculative_tokens: the drafts a step verifies; the latent cache's chunks up to one more row than that (a
        verification's) attend as rows of the decode groups (DeepSeek-V4's cache decides for itself, V4Inputs)."""
        self.cache = cache
        self.device = cache.device
        self.batched_rows = speculative_tokens + 1
        self.context_slots: dict[int, torch.Tensor] = {}  # seq_id -> [context] the slots of its positions so far
        self.v4 = V4Inputs(cache) if isinstance(cache, V4Cache) else None  # DeepSeek-V4's cache groups

    def __call__(self, batch: Batch) -> StepInputs:
        """The batch checked as received (before anything is written), the samples forked since the last step
        copied from their parents, the sequences finished, aborted or preempted since then released, those starting
        from published state restored, then the step's metadata and token ids."""
        cache = self.cache
        batch.validate(cache.block_size, cache.num_blocks)
        for fork in batch.forks:
            cache.fork(fork)
        for seq_id in batch.releases:
            self.release(seq_id)
        for restore in batch.restores:
            cache.restore(restore)
        if self._idle(batch):  # one throwaway token, its logits computed and dropped
            dummy = dummy_batch(cache.dummy_block, cache.block_size)
            return StepInputs(self._ids(dummy), self.meta(dummy), None, dummy=True)
        rows = batch.logit_rows()
        every_row = rows == list(range(batch.num_tokens))
        return StepInputs(self._ids(batch), self.meta(batch),
                          None if every_row else torch.tensor(rows, dtype=torch.long, device=self.device))

    def step_rows(self, batch: Batch) -> tuple[int, int]:
        """(tokens, logit rows) the rank running `batch` feeds the model this step, as `__call__` builds them: an
        idle rank's throwaway token is one of each."""
        if self._idle(batch):
            return 1, 1
        return batch.num_tokens, len(batch.logit_rows())

    def _idle(self, batch: Batch) -> bool:
        """An idle rank on an accelerator, which runs a throwaway token (on CPU it runs zero rows)."""
        return batch.num_tokens == 0 and batch.cp is None and self.cache.dummy_block is not None

    def release(self, seq_id: int) -> None:
        self.cache.release(seq_id)
        self.context_slots.pop(seq_id, None)
        if self.v4 is not None:
            self.v4.release(seq_id)

    def _ids(self, batch: Batch) -> torch.Tensor:
        return torch.tensor(batch.input_ids, dtype=torch.long, device=self.device)

    def meta(self, batch: Batch) -> StepMeta:
        """The step's metadata: positions, slots, each sequence's context (for the latent cache its slots and causal
        mask, and the decode groups; DeepSeek-V4's part by V4Inputs); a context-parallel share's own."""
        if batch.cp is not None:
            if self.v4 is not None:
                raise ValueError(f"invalid step batch: {type(self.cache).__name__} has no context-parallel prefill")
            return self._cp_meta(batch.cp)
        seqs, positions = [], []
        for i, seq_id in enumerate(batch.seq_ids):
            row, stop, context = batch.span(i)
            start = context - (stop - row)
            self.cache.advance(seq_id, start, context)
            positions.append(torch.arange(start, context, device=self.device))
            seqs.append(self._seq(batch, i) if self.v4 is None else SeqStep(seq_id, row, stop, context))
        flat = concat(positions, self.device)
        if self.v4 is not None:  # DeepSeek-V4: its cache groups' own metadata
            return StepMeta(seqs, flat, flat, v4=self.v4(batch, seqs))
        step_slots = torch.tensor(batch.slot_mapping, dtype=torch.long, device=self.device)
        return StepMeta(seqs, flat, step_slots, range_start(batch.slot_mapping), decodes=self._decode_groups(seqs),
                        batched_rows=self.batched_rows)

    def _seq(self, batch: Batch, i: int) -> SeqStep:
        """Sequence i of a latent-cache step: its context's slots (the last step's extended by this one's, or read from
        its block table), its causal mask, and its first slot when its blocks are consecutive."""
        seq_id, (row, stop, context) = batch.seq_ids[i], batch.span(i)
        n_new, start = stop - row, context - (stop - row)
        table = batch.block_tables[i]
        new_slots = torch.tensor(batch.slot_mapping[row:stop], dtype=torch.long, device=self.device)
        known = self.context_slots.get(seq_id)
        if start and known is not None and known.shape[0] == start:  # extended once per step, read by every layer
            context_slots = torch.cat([known, new_slots])
        else:
            context_slots = torch.tensor(slots(table, self.cache.block_size, 0, context), dtype=torch.long,
                                         device=self.device)
        self.context_slots[seq_id] = context_slots
        # a chunk the decode groups take row by row reads no mask
        causal = causal_mask(n_new, context, self.device) if n_new > self.batched_rows else None
        first_block = range_start(table)  # consecutive blocks: the context is one range of slots
        return SeqStep(seq_id, row, stop, context, context_slots, causal,
                       None if first_block is None else first_block * self.cache.block_size)

    def _cp_meta(self, cp: CPShare) -> StepMeta:
        """A context-parallel share: the new positions (from cp.start, past a cached prefix) split over the group,
        gathered in position order into a scratch of the whole prompt, the prefix first."""
        device, length, start, size = self.device, cp.length, cp.start, len(cp.group)
        shares = [cp.positions_of(member) for member in range(size)]
        most = max(map(len, shares))
        order = torch.empty(length - start, dtype=torch.long, device=device)
        ranks = sorted(cp.group)  # the gather is in rank order; members are in group order, the owner first
        for member, share in enumerate(shares):
            order[[p - start for p in share]] = torch.arange(len(share), device=device) + \
                ranks.index(cp.group[member]) * most
        positions = torch.tensor(shares[cp.member], dtype=torch.long, device=device)
        everything = torch.arange(length, device=device)
        new = everything[start:]
        causal = positions[:, None] >= everything[None]  # [T, length]
        seq = SeqStep(cp.seq_id, 0, len(shares[cp.member]), length, everything, causal, 0)
        owner_meta = prefix_slots = None
        if cp.member == 0:
            table, block_size = list(cp.block_table), self.cache.block_size
            owner_slots = slots(table, block_size, start, length)
            owner_meta = StepMeta([], new, torch.tensor(owner_slots, dtype=torch.long, device=device),
                                  range_start(owner_slots))
            if start:
                prefix_slots = torch.tensor(slots(table, block_size, 0, start), dtype=torch.long, device=device)
        step = CPStep(positions, length, most, order, self.cache.scratch(length),
                      StepMeta([], new, new, start), seq, owner_meta, start, cp.group[0], prefix_slots)
        return StepMeta([], positions, positions, None, cp=step)

    def _decode_groups(self, seqs: list[SeqStep]) -> tuple[DecodeRows, ...]:
        """The one-token sequences, and each row of the chunks of at most `batched_rows` as one over its context up
        to its own position (the step writes every row's entries before any attends), in step order, in groups
        whose padded gather stays under DECODE_GATHER_ROWS."""
        decodes = []
        for seq in seqs:
            if seq.query_len == 1:
                decodes.append(seq)
            elif seq.query_len <= self.batched_rows:
                first = seq.context_len - seq.query_len
                decodes += [SeqStep(seq.seq_id, seq.start + j, seq.start + j + 1, first + j + 1,
                                    seq.context_slots[:first + j + 1], None, seq.first_slot)
                            for j in range(seq.query_len)]
        return tuple(self._decode_rows([decodes[i] for i in group])
                     for group in gather_groups([seq.context_len for seq in decodes]))

    def _decode_rows(self, decodes: list[SeqStep]) -> DecodeRows:
        rows = [seq.start for seq in decodes]
        lens = [seq.context_len for seq in decodes]
        padded = torch.nn.utils.rnn.pad_sequence([seq.context_slots for seq in decodes], batch_first=True)
        valid = lengths_mask(lens, self.device) if min(lens) < max(lens) else None
        first_rows = rows == list(range(len(rows)))  # a slice of the step: views, no index copies
        return DecodeRows(slice(0, len(rows)) if first_rows else torch.tensor(rows, device=self.device), padded, valid,
                          decodes[0].first_slot if len(decodes) == 1 else None)


class Worker:
    """One rank's side of a step: its DP index's batch through the model and the sampler, and with speculative
    decoding the MTP layer's drafts for the next step."""

    def __init__(self, model, cache: KVCache, dist: Dist, dp_index: int, grammars: Grammars | None = None,
                 speculative: SpeculativeConfig | None = None, connector: KVConnectorWorker | None = None,
                 balancer: ExpertBalancer | None = None):
        """connector: this rank's side of the KV connectors (engine/kv_connector/); balancer: EPLB and the
        expert-load record (runner/models/eplb.py)."""
        self.model, self.cache, self.dist, self.dp_index = model, cache, dist, dp_index
        self.speculative = speculative
        self.inputs = InputBuilder(cache, speculative.num_speculative_tokens if speculative is not None else 0)
        self.grammars = grammars  # constrained decoding on this rank (serve); None: requests carry no grammar
        self.reports = dist.attn_tp_rank == 0  # attention-TP ranks of one DP index compute the same rows
        self.steps = 0  # steps this rank has run
        self.connector, self.balancer = connector, balancer
        self.connector_reports: list = []  # the connector's reports since rank 0 last took them

    @torch.inference_mode()
    def execute(self, batch: Batch, plan: list[Batch] | None = None) -> list[SeqResult] | None:
        """-> one result per sequence of the batch from the reporting rank of the DP index (None from the
        others). plan: every DP index's batch of the step (as every rank received it), from which each rank's
        rows are known without exchanging them."""
        if self.balancer is not None:  # a step boundary, on every rank: the load counted, experts moved when due
            self.balancer.before_step()
        if batch.kv is not None:  # first: a block it copies may be written, or read, below
            if self.connector is None:
                raise ValueError("invalid step batch: KV connector work on a rank without a KV connector")
            self.connector_reports += self.connector.run(batch.kv)
        inputs = self.inputs(batch)
        if self.balancer is not None:  # an idle rank's throwaway token is no load
            self.balancer.count(not inputs.dummy)
        if self.grammars is not None:
            for seq_id in batch.releases:
                self.grammars.release(seq_id)
        self.steps += 1
        batches = plan if plan is not None else [batch]
        step_rows = [self.inputs.step_rows(b) for b in batches]  # (tokens, logit rows) of every DP index
        if plan is not None:
            self.dist.plan_step(step_rows)
        # a step whose every logits row, on every DP index, is a plain draw takes only the rows' tokens from lm_head,
        # which sends candidates instead of rows (every rank decides alike, from the plan)
        draws = None if self.speculative is not None else [plain_draws(b) for b in batches]
        if draws is not None and None in draws:
            draws = None
        elif draws is not None:  # an idle rank's throwaway row (on an accelerator) draws greedily, and is dropped
            draws = [d + [THROWAWAY_DRAW] * (rows - len(d)) for d, (_, rows) in zip(draws, step_rows)]
        drafts = None
        try:
            out = self.model.forward(inputs.tokens, inputs.meta, self.cache, rows=inputs.rows, draws=draws)
            # the sampling rows of requests with a grammar masked: where they are sampled, and on every rank where
            # the MTP drafts and their verification read them (a rank that samples nothing replays a request's
            # output into its matcher when it next masks for it)
            if self.grammars is not None and not inputs.dummy and (self.reports or self.speculative is not None):
                constrain(batch.for_sampler(), out, self.grammars)
            if self.speculative is not None:
                drafts = self._draft(batch, inputs, out, plan)
        finally:
            self.dist.plan_step(None)
        if inputs.dummy:
            self.inputs.release(DUMMY_SEQ_ID)
            return [] if self.reports else None
        if not self.reports:
            return None
        if draws is not None:  # out: the rows' tokens
            return drawn_results(batch.for_sampler(), out.tolist())
        results = step_results(batch.for_sampler(), out, self.grammars)
        for result, proposed in zip(results, drafts or ()):
            result.drafts.extend(proposed)
        return results

    def take_reports(self) -> list:
        """The KV connector's reports since the last call (rank 0 gathers them after each step)."""
        reports, self.connector_reports = self.connector_reports, []
        return reports

    def finish(self, last: ConnectorMeta | None = None) -> None:
        """The end of the run, on every rank at once (the expert-load record is summed and written; last: after a
        graceful end, the KV connector's last work on this rank, such as its host tier written to disk)."""
        if last is not None and self.connector is None:
            raise ValueError("invalid stop: KV connector work on a rank without a KV connector")
        if self.connector is not None:
            self.connector.finish(last)
        if self.balancer is not None:
            self.balancer.finish()

    def _draft(self, batch: Batch, inputs: StepInputs, logits: torch.Tensor, plan: list[Batch] | None
               ) -> list[list[int]]:
        """Speculative decoding, on every rank (each runs the MTP layer's collectives the same number of times):
        per sequence of the batch the drafts its SampleSpec.propose asks for (speculative.py). The verified tokens
        are recomputed here from the logits, as the sampler computes them (sampler.verify: the same logits and the
        same seeded numbers give the same tokens on every rank)."""
        k, model, device = self.speculative.num_speculative_tokens, self.model, self.cache.device
        proposing = [] if inputs.dummy or batch.cp is not None else \
            [i for i in range(len(batch.seq_ids)) if self._drafts(batch, i, 1)]
        next_tokens = torch.zeros(inputs.tokens.shape[0], dtype=torch.long, device=device)
        rows, positions, logit_at = [], [], 0  # the proposing sequences' last accepted row, and its position
        emitted: dict[int, list[int]] = {}  # per proposing sequence: the tokens this step emits
        for i in range(len(batch.seq_ids) if not inputs.dummy and batch.cp is None else 0):
            start, stop, context = batch.span(i)
            spec, scores = batch.samples[i], batch.scores[i]
            next_tokens[start:stop - 1] = inputs.tokens[start + 1:stop]
            if batch.follow[i] is not None:
                next_tokens[stop - 1] = batch.follow[i]
            logit_at += len(scores.targets) if scores is not None else 0
            if spec is None:
                continue
            k_i = len(spec.drafts)
            if spec.propose:
                accepted = emitted[i] = verify(logits[logit_at:logit_at + k_i + 1], spec)
                rows.append(stop - 1 - k_i + len(accepted) - 1)
                positions.append(context - (stop - rows[-1]))
                next_tokens[rows[-1]] = accepted[-1]
            logit_at += k_i + 1
        self.dist.plan_step(self._mtp_plan(plan, 1))
        hidden = model.mtp(model, model.hidden, next_tokens, inputs.meta, self.cache)
        drafts: list[list[int]] = [[] for _ in batch.seq_ids]
        chain = list(zip(proposing, rows))  # (sequence, its row in `hidden`) still drafting
        position_of = dict(zip(proposing, positions))
        for j in range(1, k + 1):
            picked = torch.tensor([row for _, row in chain], dtype=torch.long, device=device)
            draft_logits = model.mtp.logits(model, hidden[picked])
            self._constrain_drafts(batch, draft_logits, [i for i, _ in chain], emitted, drafts)
            tokens = draft_logits.argmax(dim=-1)
            for (i, _), token in zip(chain, tokens.tolist()):
                drafts[i].append(token)
            if j == k:
                break
            chain_batch, kept = Batch(), []
            for n, (i, row) in enumerate(chain):
                if self._drafts(batch, i, j + 1):  # the next chained pass writes position_of[i] + j
                    chain_batch.add(batch.seq_ids[i], [drafts[i][-1]], position_of[i] + j + 1, batch.block_tables[i],
                                    self.cache.block_size, None, None)
                    kept.append(n)
            self.dist.plan_step(self._mtp_plan(plan, j + 1))
            hidden = model.mtp(model, hidden[picked[kept]], tokens[kept], self.inputs.meta(chain_batch), self.cache)
            chain = [(chain[n][0], m) for m, n in enumerate(kept)]
        return drafts

    def _constrain_drafts(self, batch: Batch, logits: torch.Tensor, drafting: list[int],
                          emitted: dict[int, list[int]], drafts: list[list[int]]) -> None:
        """The MTP layer's logits for the next draft of each drafting sequence (rows in `drafting`'s order), those of
        sequences with a grammar masked as it stands after their output, this step's tokens and their drafts so far:
        structured outputs and tool calls draft only what their grammar allows."""
        rows = [(row, batch.seq_ids[i], batch.samples[i].grammar, batch.samples[i].output,
                 tuple(emitted[i] + drafts[i])) for row, i in enumerate(drafting)
                if batch.samples[i].grammar is not None]
        if rows:
            self.grammars.constrain(logits, rows)

    def _mtp_plan(self, plan: list[Batch] | None, j: int) -> list[tuple[int, int]] | None:
        """The (tokens, logit rows) of every DP index's j-th MTP pass, from the step plan: the step's tokens and its
        drafting sequences for the first, the sequences still drafting for the chained ones."""
        if plan is None:
            return None
        counts = []
        for b in plan:
            drafting = sum(self._drafts(b, i, j) for i in range(len(b.seq_ids)))  # none when idle
            counts.append((self.inputs.step_rows(b)[0] if j == 1 else drafting, drafting))
        return counts

    def _drafts(self, batch: Batch, i: int, j: int) -> bool:
        """Whether sequence i of `batch` drafts a j-th token this step, known from the batch alone (every rank
        counts every DP index's): its SampleSpec asks for j, and the (j - 1)-th chained pass, which writes at most
        position context - 1 + j - 1 (all drafts accepted), stays within its block table."""
        spec = batch.samples[i] if batch.cp is None else None
        if spec is None or spec.propose < j:
            return False
        return batch.context_lens[i] - 1 + j - 1 < len(batch.block_tables[i]) * self.cache.block_size
