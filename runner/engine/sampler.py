"""A step's next tokens and logprobs from its rows of logits, on the rank that computed them: one sampling call
and one logprob call for all of the step's sequences.

A sampled token depends only on the row's logits and (seed, index), the token's position in the request's
output: the draw is the Gumbel-max rule of models/draw.py, each token's noise fixed by (seed, index, token id), so
the same seed gives the same tokens whatever else shares the batch, whatever the world size, after a preempted
request is recomputed, and whether lm_head TP sends the row's candidates (a step of plain draws, `plain_draws`) or
the whole row (any other step, sampled here). Top-k keeps the k largest logits (ties: the lowest id), top-p the
smallest prefix of them, in that order, whose probability reaches top_p. Rows are batched along the first dimension
and every reduction runs along the vocabulary, so no row's result depends on the other rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import math

import numpy as np
import torch

from dsconv.runner.engine.grammar import Grammars
from dsconv.runner.engine.request import SeqResult, TokenLogprob
from dsconv.runner.engine.speculative import accept_greedy
from dsconv.runner.engine.batch import Batch, SampleSpec
from dsconv.runner.models.draw import Draw, gumbel, pick_among


def constrain(batch: Batch, logits: torch.Tensor, grammars: Grammars) -> None:
    """logits [rows, vocab], the rows of batch.logit_rows(): the sampling rows of sequences with a grammar masked in
    place to the tokens it allows there, before anything reads them (on every rank: the MTP drafts and their
    verification read them too). A verifying sequence's row j, which verifies its draft j, is masked as the grammar
    stands after its output and drafts 0 .. j - 1 (verification stops at the first draft the grammar refuses,
    whose own row is masked: the rows after it are left as they are)."""
    rows, at = [], 0
    for seq_id, spec, scores in zip(batch.seq_ids, batch.samples, batch.scores):
        at += len(scores.targets) if scores is not None else 0
        if spec is None:
            continue
        if spec.grammar is not None:
            rows += [(at + j, seq_id, spec.grammar, spec.output, spec.drafts[:j]) for j in range(len(spec.drafts) + 1)]
        at += len(spec.drafts) + 1
    if rows:
        grammars.constrain(logits, rows)


def plain_draws(batch: Batch) -> list[Draw] | None:
    """The batch's logits rows as plain draws, one per sampling sequence in order, or None when some row needs the
    whole row of logits. The rule by which lm_head TP sends each rank its rows' candidates instead of their rows
    (parallel.ParallelLMHead, models/draw.py): no prompt logprobs, and every sampling sequence greedy or sampled at
    a temperature over the whole vocabulary or its top_k, with top_p 1 and no logprobs, logit_bias, grammar,
    further samples (n > 1), drafts to verify, repetition penalty, min_p or tokens held back by min_tokens. Anything
    else (top_p below 1 among them: its nucleus has no size known before the row is seen) gathers the row."""
    batch = batch.for_sampler()
    if any(scores is not None for scores in batch.scores):
        return None
    specs = [spec for spec in batch.samples if spec is not None]
    if not all(spec.top_p >= 1.0 and spec.logprobs is None and not spec.logit_bias and spec.grammar is None
               and not spec.siblings and not spec.drafts and spec.repetition_penalty == 1.0 and not spec.banned
               and not spec.min_p for spec in specs):
        return None
    return [Draw(spec.temperature, spec.top_k, spec.seed, spec.index) for spec in specs]


def drawn_results(batch: Batch, tokens: list[int]) -> list[SeqResult]:
    """A batch of `plain_draws`' results from its sampling rows' drawn tokens (one per sampling sequence, in order):
    what step_results gives from their logits."""
    drawn = iter(tokens)
    return [SeqResult(None if spec is None else next(drawn), None) for spec in batch.samples]


@dataclass
class _Rows:
    """Where each sequence's rows are in a step's logits (batch.logit_rows()): per sequence its scored prompt rows,
    then for a sampling sequence the rows verifying its drafts and its draw row."""
    draw: list[int] = field(default_factory=list)  # per sampling sequence
    verify: list[range] = field(default_factory=list)  # per sampling sequence: the rows before its draw row
    score: list[int] = field(default_factory=list)
    score_targets: list[int] = field(default_factory=list)
    score_tops: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, batch: Batch) -> "_Rows":
        rows, at = cls(), 0
        for spec, scores in zip(batch.samples, batch.scores):
            if scores is not None:
                rows.score += range(at, at + len(scores.targets))
                rows.score_targets += scores.targets
                rows.score_tops += [scores.top] * len(scores.targets)
                at += len(scores.targets)
            if spec is not None:
                rows.verify.append(range(at, at + len(spec.drafts)))
                at += len(spec.drafts)
                rows.draw.append(at)
                at += 1
        return rows


def step_results(batch: Batch, logits: torch.Tensor, grammars: Grammars | None = None) -> list[SeqResult]:
    """logits [rows, vocab], the rows of batch.logit_rows() (per sequence: its scored rows, then its sampling
    row), those of sequences with a grammar already masked (`constrain`) -> per sequence its sampled token and
    logprobs, and its siblings' (n > 1: further draws from the same row with their own seeds). A row's logit_bias
    is added first (in place, so the siblings' draws and the logprobs follow it); grammars' matchers take the
    tokens each sequence emits. A sequence verifying drafts (speculative decoding) emits what `verify` gives for
    its rows, each token with the target's logprob at its row."""
    rows = _Rows.of(batch)
    specs = [spec for spec in batch.samples if spec is not None]
    drawing = [seq_id for seq_id, spec in zip(batch.seq_ids, batch.samples) if spec is not None]
    for row, spec in zip(rows.draw, specs):
        adjust(logits, row, spec)
    # the siblings' draws follow the sequences' own: (row, spec) per draw
    sibling_draws = [(row, dataclasses.replace(spec, seed=seed, siblings=()))
                     for row, spec in zip(rows.draw, specs) for seed in spec.siblings]
    drawn_rows = rows.draw + [row for row, _ in sibling_draws]
    all_specs = specs + [spec for _, spec in sibling_draws]
    every_row = drawn_rows == list(range(logits.shape[0]))  # a decode step: no copy of the logits
    tokens = sample(logits if every_row else logits[drawn_rows], all_specs).tolist() if all_specs else []
    emitted = [[token] for token in tokens[:len(specs)]]  # per sampling sequence, in order; rows per token
    emitted_rows = [[row] for row in rows.draw]
    for i, spec in enumerate(specs):
        if spec.drafts:
            rows_i = [*rows.verify[i], rows.draw[i]]
            emitted[i] = verify(logits[rows_i], spec)
            emitted_rows[i] = rows_i[:len(emitted[i])]
    for seq_id, spec, tokens_i in zip(drawing, specs, emitted):
        for token in tokens_i if spec.grammar is not None else ():
            grammars.accept(seq_id, token)
    # the drawn tokens' logprobs where the request asks for them: every token a verifying sequence emits, then the
    # siblings'
    asked = [(row, token, spec.logprobs) for rows_i, tokens_i, spec in zip(emitted_rows, emitted, specs)
             if spec.logprobs is not None for row, token in zip(rows_i, tokens_i)]
    asked += [(row, token, spec.logprobs) for row, token, spec in zip(drawn_rows[len(specs):], tokens[len(specs):],
                                                                      all_specs[len(specs):])
              if spec.logprobs is not None]
    results = _results(batch, specs, logits, rows, asked, emitted, tokens[len(specs):])
    for seq_id, result in zip(batch.seq_ids, results) if grammars is not None and grammars.failed else ():
        result.error = grammars.failed.get(seq_id)
    return results


def _results(batch: Batch, specs: list[SampleSpec], logits: torch.Tensor, rows: _Rows,
             asked: list[tuple[int, int, int]], emitted: list[list[int]], sibling_tokens: list[int]) -> list[SeqResult]:
    """Per sequence: its scored prompt tokens' logprobs, the tokens it emitted with theirs where asked (`asked`:
    (row, token, top entries)), and its siblings' draws (specs: the sampling sequences', in order)."""
    logprob_rows = rows.score + [row for row, _, _ in asked]
    entries = token_logprobs(logits[logprob_rows], rows.score_targets + [token for _, token, _ in asked],
                             rows.score_tops + [top for _, _, top in asked]) if logprob_rows else []
    scored, drawn = iter(entries[:len(rows.score)]), iter(entries[len(rows.score):])
    results, sampled = [], iter(emitted)
    for spec, scores in zip(batch.samples, batch.scores):
        prompt = [next(scored) for _ in scores.targets] if scores is not None else []
        if spec is None:
            results.append(SeqResult(None, None, prompt))
            continue
        mine = next(sampled)
        logprobs = [next(drawn) if spec.logprobs is not None else None for _ in mine]
        results.append(SeqResult(mine[0], logprobs[0], prompt, extra=list(zip(mine[1:], logprobs[1:]))))
    siblings = iter(sibling_tokens)
    for result, spec in zip([r for r, spec in zip(results, batch.samples) if spec is not None], specs):
        result.siblings.extend((next(siblings), next(drawn) if spec.logprobs is not None else None)
                               for _ in spec.siblings)
    return results


def adjust(logits: torch.Tensor, row: int, spec: SampleSpec) -> None:
    """A sampling row's logits changed in place by what its request asks, in vLLM's order: logit_bias added; the
    tokens min_tokens holds back set to -inf; then the repetition penalty (CTRL, Keskar et al. 2019, as vLLM and
    transformers' RepetitionPenaltyLogitsProcessor apply it) on every distinct token of the prompt and output: a
    positive logit divided by the penalty, a negative one multiplied."""
    if spec.logit_bias:
        ids, biases = zip(*spec.logit_bias)
        logits[row, list(ids)] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)
    if spec.banned:
        logits[row, list(spec.banned)] = -torch.inf
    if spec.repetition_penalty != 1.0 and spec.seen:
        seen = torch.tensor(spec.seen, device=logits.device)
        values = logits[row, seen]
        logits[row, seen] = torch.where(values > 0, values / spec.repetition_penalty,
                                        values * spec.repetition_penalty)


def verify(logits: torch.Tensor, spec: SampleSpec) -> list[int]:
    """A sequence's k + 1 verification rows [k + 1, vocab] and its SampleSpec with k drafts -> the tokens the step
    emits. Greedy: speculative.accept_greedy. Sampled (speculative sampling, Leviathan et al. and Chen et al., with a
    one-hot draft distribution: the MTP layer's drafts are its argmax): draft j is accepted with probability p_j(d_j),
    p_j the target's distribution at its row after temperature, top-k and top-p, by the uniform number
    `accept_uniform(seed, index)`; at the first rejection the token is drawn from p_j without d_j (renormalized) by
    the row's Gumbel noise at (seed, index); after k acceptances the bonus token is drawn from p_k as any draw. Each
    emitted token is then distributed as p at its position, whatever the drafts: P(x) = p(d) [x = d] + (1 - p(d))
    p(x) / (1 - p(d)) [x != d] = p(x). `index` is the token's position in the request's output, so the numbers
    depend only on (seed, index), as without speculation."""
    k = len(spec.drafts)
    if not spec.temperature:
        return accept_greedy(logits.argmax(dim=-1).tolist(), spec.drafts)
    specs = [dataclasses.replace(spec, index=spec.index + j, drafts=()) for j in range(k + 1)]
    probs = filtered_probs(logits, specs)  # [k + 1, vocab] float64
    emitted = []
    for j, draft in enumerate(spec.drafts):
        if accept_uniform(spec.seed, spec.index + j) < probs[j, draft].item():
            emitted.append(draft)
            continue
        emitted.append(gumbel_pick(without(probs[j], draft), spec.seed, spec.index + j))
        return emitted
    return emitted + draw(logits[k:], specs[k:]).tolist()  # the bonus token: drawn as any draw at its index


def without(probs: torch.Tensor, token: int) -> torch.Tensor:
    """A rejected draft's residual distribution: probs [vocab] with the draft's share taken out (its one-hot draft
    distribution subtracted, clipped at 0), to be renormalized by the draw."""
    residual = probs.clone()
    residual[token] = 0.0
    return residual


def filtered_probs(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """logits [rows, vocab] -> float64 [rows, vocab]: each row's distribution at its temperature, restricted to its
    top_k and top_p nucleus and renormalized, in vocabulary order (what `draw` samples from)."""
    device = logits.device
    temperature = torch.tensor([spec.temperature for spec in specs], dtype=torch.float32, device=device)
    values, ids = logits.float().sort(dim=-1, descending=True, stable=True)  # `draw`'s order
    sorted_probs = torch.softmax(values / temperature[:, None], dim=-1)
    in_keep = torch.arange(values.shape[-1], device=device) < kept(sorted_probs, specs)[:, None]
    mass = torch.where(in_keep, sorted_probs, 0.0).double()
    mass = mass / mass.sum(dim=-1, keepdim=True)
    return torch.zeros_like(mass).scatter_(-1, ids, mass)


def gumbel_pick(probs: torch.Tensor, seed: int, index: int) -> int:
    """probs [vocab] (non-negative weights) -> the token of largest log(weight) + G(seed, index, token), a sample of
    the weights renormalized (the Gumbel-max rule of models/draw.py on log-probabilities)."""
    kept_ids = torch.nonzero(probs > 0)[:, 0]
    score = probs[kept_ids].log() + gumbel(seed, index, kept_ids).double()
    return int(kept_ids[score == score.max()].min())


def sample(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """logits [rows, vocab], one spec per row -> [rows] token ids: the argmax where the temperature is 0, else a
    draw from the distribution at the row's temperature restricted to its top_k largest logits and its top_p
    nucleus."""
    tokens = logits.argmax(dim=-1)
    drawn = [i for i, spec in enumerate(specs) if spec.temperature != 0.0]
    if drawn:
        rows = torch.tensor(drawn, device=logits.device)
        tokens[rows] = draw(logits[rows], [specs[i] for i in drawn])
    return tokens


def draw(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """logits [rows, vocab] -> [rows] token ids: each row's kept tokens (its top_k largest logits, ties by id, cut to
    its top_p nucleus) as candidates of models/draw.py's rule, which lm_head TP's plain draws also follow."""
    device = logits.device
    temperature = torch.tensor([spec.temperature for spec in specs], dtype=torch.float32, device=device)
    values, ids = logits.float().sort(dim=-1, descending=True, stable=True)  # ties: the lowest id first
    probs = torch.softmax(values / temperature[:, None], dim=-1)  # descending too: softmax keeps the order
    keep = kept(probs, specs).tolist()
    return torch.tensor([pick_among(values[row, :n], ids[row, :n], Draw(spec.temperature, spec.top_k, spec.seed,
                                                                        spec.index))
                         for row, (n, spec) in enumerate(zip(keep, specs))], dtype=torch.long, device=device)


def kept(probs: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """probs [rows, vocab], each row sorted descending -> [rows] how many of the most likely tokens each row
    keeps: at most its top_k, the smallest prefix whose mass reaches its top_p, and those of at least min_p x the
    first's probability."""
    device, vocab = probs.device, probs.shape[-1]
    top_k = torch.tensor([min(spec.top_k or vocab, vocab) for spec in specs], device=device)
    # top_p is compared in float32, the probabilities' type; no nucleus (inf) where top_p is 1
    top_p = torch.tensor([spec.top_p if spec.top_p < 1.0 else math.inf for spec in specs], dtype=torch.float32,
                         device=device)
    before = probs.cumsum(dim=-1) - probs  # the mass of the tokens more likely than each token
    nucleus = (before < top_p[:, None]).sum(dim=-1).clamp(min=1)  # stays while the mass before is below top_p
    # min_p (vLLM's, transformers' MinPLogitsWarper): at least min_p x the most likely token's probability
    min_p = torch.tensor([spec.min_p for spec in specs], dtype=torch.float32, device=device)
    likely = (probs >= min_p[:, None] * probs[:, :1]).sum(dim=-1)
    return torch.minimum(torch.minimum(top_k, nucleus), likely)


ACCEPT_STREAM = 1  # a third word in the seed sequence: speculative acceptance's numbers, apart from the draws'


def accept_uniform(seed: int, index: int) -> float:
    """The number speculative sampling accepts the draft at output position `index` by: fixed by (seed, index) and
    independent of the Gumbel noise at (seed, index), which draws the token when the draft is rejected."""
    return float(np.random.default_rng([seed % 2**64, index, ACCEPT_STREAM]).random())


def token_logprobs(logits: torch.Tensor, targets: list[int], tops: list[int]) -> list[TokenLogprob]:
    """logits [rows, vocab] -> per row its target token's logprob and its `top` most likely tokens' (the model's
    log-softmax, before any sampling filter)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, torch.tensor(targets, device=logp.device)[:, None]).squeeze(-1).tolist()
    best: list[dict[int, float]] = [{} for _ in targets]
    for top in set(tops) - {0}:  # one topk per width: a wider one may pick other ids among equal values
        rows = [i for i, t in enumerate(tops) if t == top]
        values, ids = logp[rows].topk(top, dim=-1)
        for i, row_ids, row_values in zip(rows, ids.tolist(), values.tolist()):
            best[i] = dict(zip(row_ids, row_values))
    return [TokenLogprob(token, logprob, top) for token, logprob, top in zip(targets, chosen, best)]
