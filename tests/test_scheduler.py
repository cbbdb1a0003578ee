"""The serving engine's parts without HTTP: token-major batches and their checks, the continuous-batching
scheduler (chunked prefill, admission order, preemption and recompute, DP placement), and seeded sampling
against a NumPy reference of temperature / top-k / top-p, batched sampling and logprobs against a per-row
reference."""

import random

import numpy as np
import pytest
import torch

from dsconv.errors import InputError
from dsconv.runner.engine.batch import Batch, PromptScores, SampleSpec
from dsconv.runner.models.dist import Dist
from dsconv.runner.engine.config import EngineConfig, SchedulerConfig
from dsconv.runner.engine.core import new_engine
from dsconv.runner.models.registry import build_model
from dsconv.runner.engine.request import SamplingParams, SeqResult, TokenLogprob
from dsconv.runner.engine.sampler import sample, step_results
from dsconv.runner.models.draw import gumbel
from dsconv.runner.engine.scheduler import PoolShape, Scheduler
from dsconv.runner.models.weights import load_manifest
from dsconv.family.layout import Layout
from tests.helpers import shard

VOCAB = 50


def scheduler(dp=1, num_blocks=64, block_size=4, max_num_seqs=8, budget=64, balancing="least-loaded"):
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, balancing=balancing),
                     PoolShape(dp=dp, num_blocks=num_blocks, block_size=block_size))


def fake_results(step):
    """A deterministic 'model': the next token is the last fed token + 1 (mod VOCAB); a sibling draw k (n > 1)
    adds k more."""
    results = []
    for batch in step.batches:
        rank = []
        for i, spec in enumerate(batch.samples):
            if spec is None:
                rank.append(SeqResult(None, None))
                continue
            token = (batch.input_ids[batch.query_start_loc[i + 1] - 1] + 1) % VOCAB
            rank.append(SeqResult(token, None, siblings=[((token + k) % VOCAB, None)
                                                         for k in range(1, len(spec.siblings) + 1)]))
        results.append(rank)
    return results


def run(s, on_step=None, max_steps=1000):
    """Steps until every request has finished -> request id -> output tokens."""
    outputs = {}
    for _ in range(max_steps):
        step = s.schedule()
        if step is None:
            return outputs
        if on_step is not None:
            on_step(step)
        for request, out in s.update(step, fake_results(step)):
            outputs.setdefault(request.request_id, []).extend(out.new_token_ids)
    raise AssertionError("the requests did not finish")


def greedy(max_tokens, **kwargs):
    return SamplingParams(max_tokens=max_tokens, **kwargs)


# -- batches ---------------------------------------------------------------------------------------------------

def valid_batch():
    batch = Batch()
    batch.add(0, [1, 2, 3], 3, [5], 4, SampleSpec(0.0, 1.0, 0, 0, 0, None), None)
    batch.add(1, [7], 6, [2, 9], 4, SampleSpec(0.0, 1.0, 0, 0, 0, None), None)
    return batch


def test_batch_is_token_major_and_validates():
    batch = valid_batch()
    batch.validate(block_size=4, num_blocks=10)
    assert batch.query_start_loc == [0, 3, 4] and batch.context_lens == [3, 6]
    assert batch.slot_mapping == [20, 21, 22, 9 * 4 + 1]  # position 5 of the second sequence: block 9, offset 1
    assert batch.logit_rows() == [2, 3]


@pytest.mark.parametrize("breaks,message", [
    (lambda b: b.slot_mapping.__setitem__(0, 99), "slot_mapping disagrees"),
    (lambda b: b.block_tables[1].__setitem__(1, 10), "outside"),
    (lambda b: b.block_tables[1].__setitem__(0, 5), "writes a block another sequence holds"),
    (lambda b: b.context_lens.__setitem__(0, 2), "context 2 < query 3"),
    (lambda b: b.query_start_loc.__setitem__(1, 0), "feeds 0 tokens"),
    (lambda b: b.seq_ids.__setitem__(1, 0), "appears twice"),
    (lambda b: b.context_lens.__setitem__(1, 9), "2 blocks for 9 tokens"),
    (lambda b: b.samples.pop(), "samples has 1 entries"),
])
def test_batch_checks_name_the_broken_invariant(breaks, message):
    batch = valid_batch()
    breaks(batch)
    with pytest.raises(ValueError, match=message):
        batch.validate(block_size=4, num_blocks=10)


# -- scheduling ------------------------------------------------------------------------------------------------

def test_long_prompt_is_prefilled_in_chunks_within_the_budget():
    s = scheduler(budget=8)
    s.add("a", list(range(20)), greedy(3), None)
    fed = []
    outputs = run(s, lambda step: fed.append((step.batches[0].num_tokens, step.batches[0].samples[0] is not None)))
    assert fed == [(8, False), (8, False), (4, True), (1, True), (1, True)]
    assert outputs["a"] == [20, 21, 22]


def test_running_decodes_come_before_new_prompts():
    s = scheduler(budget=6)
    s.add("old", [1, 2], greedy(4), None)
    run_one = s.schedule()
    s.update(run_one, fake_results(run_one))
    s.add("new", list(range(10)), greedy(2), None)
    batch = s.schedule().batches[0]
    assert batch.seq_ids == [s.requests["old", 0].seq_id, s.requests["new", 0].seq_id]
    assert batch.query_start_loc == [0, 1, 6]  # the old request's one token, then 5 of the new prompt


def test_preempted_request_is_recomputed_and_gives_the_same_tokens():
    # 6 blocks of 4 tokens: two requests of 8 + 8 tokens cannot both finish in the cache at once
    alone = run_pair(scheduler(num_blocks=64), expect_preemption=False)
    tight = scheduler(num_blocks=6)
    assert run_pair(tight, expect_preemption=True) == alone
    assert all(not table for table in tight.ranks[0].blocks.tables.values()) and tight.ranks[0].blocks.num_free == 6


def run_pair(s, expect_preemption):
    s.add("first", [1, 2, 3, 4, 5, 6, 7, 8], greedy(8), None)
    s.add("second", [30, 31, 32, 33, 34, 35, 36, 37], greedy(8), None)
    preempted, released = [], []

    def watch(step):
        preempted.append(sum(step.preempted))
        released.extend(step.batches[0].releases)

    outputs = run(s, watch)
    assert (sum(preempted) > 0) == expect_preemption
    if expect_preemption:
        assert s.ranks[0].blocks.num_blocks == 6 and released  # the victim's cache is freed on the rank
    return outputs


def test_a_request_that_can_never_fit_is_refused_at_once():
    s = scheduler(num_blocks=4)  # 16 tokens
    with pytest.raises(InputError, match="need 17 tokens of KV cache; a DP rank holds 16"):
        s.add("big", list(range(9)), greedy(8), None)
    with pytest.raises(InputError, match="DP rank 3 is not between 0 and 1"):
        scheduler(dp=2).add("pinned", [1], greedy(1), None, dp_rank=3)


def test_least_loaded_placement_counts_tokens_not_requests():
    s = scheduler(dp=2)
    assert s.add("long", list(range(40)), greedy(40), None).dp_rank == 0
    assert s.add("short1", [1, 2], greedy(2), None).dp_rank == 1
    # over short2's 2 steps rank 0 feeds 40 prompt tokens + 2, rank 1 short1's 2 + 2
    assert s.add("short2", [1, 2], greedy(2), None).dp_rank == 1
    assert s.add("pinned", [1], greedy(1), None, dp_rank=0).dp_rank == 0
    robin = scheduler(dp=2, balancing="round-robin")
    assert [robin.add(str(i), [1], greedy(1), None).dp_rank for i in range(4)] == [0, 1, 0, 1]


def test_least_loaded_placement_evens_out_decoding_requests():
    """One long request and many short ones: the short ones spread over both ranks rather than all avoiding the
    long one (which feeds one token a step, like any other decoding request)."""
    s = scheduler(dp=2, num_blocks=512)
    s.add("long", [1, 2], greedy(1000), None)
    s.update(step := s.schedule(), fake_results(step))
    ranks = [s.add(str(i), [1, 2], greedy(10), None).dp_rank for i in range(5)]
    assert sorted(ranks) == [0, 0, 1, 1, 1]


def test_idle_dp_ranks_get_zero_token_batches():
    s = scheduler(dp=3)
    s.add("a", [1, 2, 3], greedy(1), None, dp_rank=1)
    step = s.schedule()
    assert [b.num_tokens for b in step.batches] == [0, 3, 0]


def test_abort_frees_the_cache_and_tells_the_rank():
    s = scheduler()
    s.add("a", list(range(10)), greedy(5), None)
    s.update(step := s.schedule(), fake_results(step))
    [(request, out)] = s.abort("a")
    assert out.finished and out.finish_reason == "abort" and s.ranks[0].blocks.num_free == 64
    assert s.schedule() is None and s.ranks[0].releases == [request.seq_id]
    assert s.abort("a") == []  # aborting twice is harmless


# -- n > 1: samples of one prefill ----------------------------------------------------------------------------

def run_samples(s, on_step=None):
    """Steps until every request has finished -> (request id, sample) -> output tokens."""
    outputs = {}
    while (step := s.schedule()) is not None:
        if on_step is not None:
            on_step(step)
        for _, out in s.update(step, fake_results(step)):
            outputs.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
    return outputs


def test_samples_prefill_once_and_share_the_prompts_full_blocks():
    s = scheduler(block_size=4)
    s.add("r", list(range(1, 11)), SamplingParams(max_tokens=3, n=3, temperature=1.0, seed=40), None)
    step = s.schedule()
    [batch] = step.batches
    assert batch.num_tokens == 10 and batch.samples[0].seed == 40 and batch.samples[0].siblings == (41, 42)
    outputs = s.update(step, fake_results(step))
    assert [(out.index, out.new_token_ids) for _, out in outputs] == [(0, [11]), (1, [12]), (2, [13])]
    parent = s.requests["r", 0]
    children = [s.requests["r", i] for i in (1, 2)]
    assert [c.seed for c in children] == [41, 42]
    pool = s.ranks[0].blocks
    table = pool.tables[parent.seq_id]
    for child in children:  # 10 tokens: blocks 0 and 1 are full and shared, block 2 is copied
        assert pool.tables[child.seq_id][:2] == table[:2] and pool.tables[child.seq_id][2] != table[2]
    assert [pool.holders[b] for b in table] == [3, 3, 1]

    step = s.schedule()
    [batch] = step.batches
    assert batch.input_ids == [11, 12, 13]  # one token per sample: the prompt is not fed again
    assert [(f.parent, f.child, f.copies) for f in batch.forks] == \
        [(parent.seq_id, c.seq_id, ((table[2], pool.tables[c.seq_id][2]),)) for c in children]
    assert not s.ranks[0].forks  # a fork goes to the ranks once
    for _, out in s.update(step, fake_results(step)):
        pass
    outputs = run_samples(s)
    assert outputs == {("r", 0): [13], ("r", 1): [14], ("r", 2): [15]}
    assert pool.num_free == pool.num_blocks and not any(pool.holders)


def test_samples_without_room_to_fork_recompute_and_give_the_same_tokens():
    def samples(num_blocks):
        s = scheduler(num_blocks=num_blocks, block_size=4, budget=16)
        s.add("a", list(range(1, 11)), SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=0), None)
        s.add("b", list(range(20, 27)), SamplingParams(max_tokens=5, n=2, temperature=1.0, seed=9), None)
        forks = []
        outputs = run_samples(s, lambda step: forks.extend(step.batches[0].forks))
        pool = s.ranks[0].blocks
        assert pool.num_free == num_blocks and not any(pool.holders)
        return outputs, len(forks), s.preemptions

    ample, forks, preemptions = samples(64)
    assert forks == 3 and preemptions == 0 and sorted(ample) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
    for num_blocks in (5, 6, 8):  # 16 tokens of "a" need 4 blocks: forks fail, samples are preempted
        tight, forks, preemptions = samples(num_blocks)
        assert tight == ample and (forks < 3 or preemptions > 0)


def test_aborting_samples():
    s = scheduler()
    s.add("r", [1, 2, 3], SamplingParams(max_tokens=5, n=3), None)
    aborted = s.abort("r")  # before its samples are drawn: all n end
    assert [(out.index, out.finish_reason) for _, out in aborted] == [(0, "abort"), (1, "abort"), (2, "abort")]
    s.add("r", [1, 2, 3], SamplingParams(max_tokens=5, n=3), None)
    s.update(step := s.schedule(), fake_results(step))
    [(_, out)] = s.abort("r", 1)
    assert out.index == 1 and sorted(s.requests) == [("r", 0), ("r", 2)]
    assert sorted(run_samples(s)) == [("r", 0), ("r", 2)]


def test_samples_count_against_max_num_seqs():
    s = scheduler(max_num_seqs=3)
    with pytest.raises(InputError, match="n=4 samples run at once as 4 sequences; a DP rank runs at most 3"):
        s.add("r", [1], SamplingParams(max_tokens=1, n=4), None)
    s.add("one", [1, 2], greedy(3), None)
    s.add("three", [5, 6], SamplingParams(max_tokens=2, n=3), None)
    assert s.schedule().batches[0].seq_ids == [s.requests["one", 0].seq_id]  # 1 + 3 sequences do not fit


def test_prompt_scoring_without_generation():
    s = scheduler(budget=4)
    s.add("score", list(range(10)), greedy(0, prompt_logprobs=1), None)
    targets = []
    finished = None
    while (step := s.schedule()) is not None:
        batch = step.batches[0]
        assert batch.samples == [None]
        targets += batch.scores[0].targets
        results = [[SeqResult(None, None, [object()] * len(batch.scores[0].targets))]]
        for _, out in s.update(step, results):
            finished = out
    assert targets == list(range(1, 10))  # rows predict the next prompt token; the last row predicts nothing
    assert finished.finished and finished.finish_reason == "length" and len(finished.prompt_logprobs) == 10


def engine(model, cache, max_num_seqs: int, budget: int, prefix_caching: bool = True):
    """dsrun's engine on one rank, stepped by the test through its scheduler."""
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                enable_prefix_caching=prefix_caching)
    return new_engine(model, cache, Dist(), EngineConfig(vocab_size=model.cfg.vocab_size, max_model_len=4096,
                                                         scheduler=scheduler))


# (block size, prompt lengths, a cache too small for both): 21 + 12 and 30 + 12 tokens do not fit together in 4
# blocks of 16; in 2 blocks of 64 the two prompts start, and the 60-token one's 5th new token needs the other's block
TIGHT = {16: ((21, 30), 64), 64: ((60, 50), 128)}


@pytest.mark.parametrize("family,block_size", [("deepseek_v32", 16), ("deepseek_v32", 64), ("deepseek_v4", 16),
                                               ("deepseek_v4", 64)])
def test_model_tokens_survive_chunking_and_preemption(family, block_size, tiny_source, tmp_path):
    """The real step function: tokens with a cache too small for both requests (preemption, recompute) and a
    budget that chunks every prompt equal those of each request alone with room to spare, in blocks of 16 and of
    64 tokens."""
    shards = tmp_path / "shards"
    shard(tiny_source(family, "fp8"), shards, Layout(1, 1, 1, 1))
    model, _, new_cache = build_model(shards, load_manifest(shards), 0, Dist(), torch.float32)
    gen = torch.Generator().manual_seed(1)
    lengths, tight_cache = TIGHT[block_size]
    prompts = [torch.randint(2, model.cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]

    def generate(cache_tokens, budget, ps):
        cache = new_cache(cache_tokens, block_size=block_size)
        core = engine(model, cache, 4, budget)
        s = core.scheduler
        outputs = {str(i): [] for i in range(len(ps))}
        for i, p in enumerate(ps):
            s.add(str(i), p, greedy(12), None)
        while s.has_work:
            for request, out in core.step():
                outputs[request.request_id] += out.new_token_ids
        return [outputs[str(i)] for i in range(len(ps))], s

    alone = [generate(256, 256, [p])[0][0] for p in prompts]
    tight, s = generate(tight_cache, 7, prompts)
    assert s.preemptions > 0 and tight == alone


@pytest.mark.parametrize("family,kv_cache_dtype", [("deepseek_v32", "auto"), ("deepseek_v32", "int8"),
                                                   ("deepseek_v4", "auto")])
def test_model_samples_equal_requests_with_their_seeds(family, kv_cache_dtype, tiny_source, tmp_path):
    """The real step function: the n samples of one prefill (forked caches, shared blocks) give the tokens of n
    requests of one sample with seeds seed, seed + 1, ..., with room to fork and with a cache so small that
    forks fail and samples are preempted."""
    shards = tmp_path / "shards"
    shard(tiny_source(family, "fp8"), shards, Layout(1, 1, 1, 1))
    model, _, new_cache = build_model(shards, load_manifest(shards), 0, Dist(), torch.float32)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, model.cfg.vocab_size, (n,), generator=gen).tolist() for n in (21, 37)]

    def params(n, seed):
        return SamplingParams(max_tokens=10, temperature=1.0, seed=seed, n=n)

    def generate(cache_tokens, requests, prefix_caching=True):
        cache = new_cache(cache_tokens, kv_cache_dtype)
        core = engine(model, cache, 8, 64, prefix_caching)
        s = core.scheduler
        outputs = {}
        for request_id, prompt, p in requests:
            s.add(request_id, prompt, p, None)
        while s.has_work:
            for _, out in core.step():
                outputs.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        return outputs, s.preemptions

    alone = {(str(i), j): generate(256, [("x", p, params(1, 100 * i + j))])[0]["x", 0]
             for i, p in enumerate(prompts) for j in range(3)}
    assert len({tuple(tokens) for tokens in alone.values()}) > 1  # the seeds draw different samples
    together = [(str(i), p, params(3, 100 * i)) for i, p in enumerate(prompts)]
    ample, preemptions = generate(512, together)
    assert ample == alone and preemptions == 0
    # 5 blocks of 16 for 21 + 10 and 37 + 10 tokens, 3 samples each; without prefix caching a sample whose fork
    # fails recomputes its prompt, and samples are preempted; with it the prompt's published blocks serve it
    tight, preemptions = generate(80, together, prefix_caching=False)
    assert tight == alone and preemptions > 0
    assert generate(80, together)[0] == alone


# -- sampling --------------------------------------------------------------------------------------------------

def sample_row(logits, spec):
    """The batched sampler on a batch of one row."""
    return int(sample(logits[None], [spec])[0])


def reference_probs(logits, temperature, top_k, top_p):
    """NumPy: softmax at temperature, keep the top_k most likely and the smallest prefix reaching top_p."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = order[:top_k] if top_k else order
    mass = np.cumsum(p[keep]) - p[keep]
    keep = keep[mass < top_p] if top_p < 1 else keep
    out = np.zeros_like(p)
    out[keep] = p[keep]
    return out / out.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (1.0, 4, 0.9)])
def test_sampling_follows_the_reference_distribution(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 0.3, 0.2, -1.0, 0.9])
    want = reference_probs(logits.numpy(), temperature, top_k, top_p)
    draws = 4000
    counts = np.bincount([sample_row(logits, SampleSpec(temperature, top_p, top_k, seed, 0, None))
                          for seed in range(draws)], minlength=len(want))
    assert np.all(counts[want == 0] == 0)  # filtered tokens are never drawn
    sigma = np.sqrt(want * (1 - want) / draws)
    assert np.all(np.abs(counts / draws - want) <= 4 * sigma + 1e-9), (counts / draws, want)


def test_sampling_depends_on_seed_and_index_only():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    spec = SampleSpec(1.0, 1.0, 0, seed=7, index=3, logprobs=None)
    first = sample_row(logits, spec)
    assert all(sample_row(logits.clone(), spec) == first for _ in range(5))
    draws = {sample_row(logits, SampleSpec(1.0, 1.0, 0, 7, index, None)) for index in range(30)}
    assert len(draws) > 5  # successive positions draw different numbers
    assert sample_row(logits, SampleSpec(0.0, 1.0, 0, 7, 0, None)) == int(logits.argmax())
    assert sample_row(logits, SampleSpec(1.0, 1.0, 1, 7, 0, None)) == int(logits.argmax())  # top_k 1 is greedy


# -- batched sampling against the per-row reference ------------------------------------------------------------

def reference_sample(logits, spec):
    """One row at a time: logits [vocab] -> token id. Greedy: the argmax. Sampled: the kept tokens (the top_k largest
    logits, ties by id, cut to the smallest prefix whose float32 probability mass reaches top_p), then the Gumbel-max
    rule over them: the largest float32 logit / temperature + G(seed, index, id), the lowest id among equals."""
    if spec.temperature == 0.0:
        return int(logits.argmax())
    values, ids = logits.float().sort(descending=True, stable=True)
    probs = torch.softmax(values / spec.temperature, dim=-1)
    keep = probs.shape[0] if spec.top_k == 0 else min(spec.top_k, probs.shape[0])
    if spec.top_p < 1.0:
        before = probs.cumsum(0) - probs
        keep = min(keep, max(1, int((before < spec.top_p).sum())))
    score = values[:keep] / torch.tensor(spec.temperature) + gumbel(spec.seed, spec.index, ids[:keep])
    return int(ids[:keep][score == score.max()].min())


def reference_token_logprob(row_log_probs, token, top):
    best = {}
    if top:
        values, ids = row_log_probs.topk(top)
        best = dict(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(row_log_probs[token]), best)


def reference_step_results(batch, logits):
    """Sequence by sequence: a log-softmax over its rows, then its scored rows' entries and its sampled token."""
    results, at = [], 0
    for scores, spec in zip(batch.scores, batch.samples):
        n_scored = len(scores.targets) if scores is not None else 0
        seq_logits = logits[at:at + n_scored + (spec is not None)]
        at += seq_logits.shape[0]
        logp = torch.log_softmax(seq_logits.float(), dim=-1)
        scored = [reference_token_logprob(logp[j], t, scores.top) for j, t in enumerate(scores.targets)] \
            if n_scored else []
        token = logprob = None
        if spec is not None:
            token = reference_sample(seq_logits[-1], spec)
            if spec.logprobs is not None:
                logprob = reference_token_logprob(logp[-1], token, spec.logprobs)
        results.append(SeqResult(token, logprob, scored))
    return results


def random_specs(rng, n):
    """Greedy, temperature, top-p and top-k rows (some top_p just under 1, some top_k past the vocabulary)."""
    return [SampleSpec(temperature=rng.choice([0.0, 0.0, 1.0, 0.7, 1.3, 0.05, 5.0, 100.0]),
                       top_p=rng.choice([1.0, 1.0, 0.9, 0.5, 0.95, 0.999, 0.1, 1 - 1e-9]),
                       top_k=rng.choice([0, 0, 1, 3, 40, 10**6]), seed=rng.getrandbits(63), index=rng.randrange(500),
                       logprobs=rng.choice([None, None, 0, 2, 5])) for _ in range(n)]


def random_logits(gen, rows, vocab, dtype):
    logits = torch.randn(rows, vocab, generator=gen) * torch.rand(rows, 1, generator=gen) * 8
    logits[:rows // 4] = (logits[:rows // 4] * 2).round() / 2  # rows with many equal logits (ties by token id)
    return logits.to(dtype)


@pytest.mark.parametrize("vocab,rows,dtype", [(7, 200, torch.float32), (50, 300, torch.float32),
                                              (1000, 200, torch.float32), (1000, 100, torch.bfloat16),
                                              (129280, 12, torch.float32)])
def test_batched_sampling_equals_the_per_row_reference_whatever_the_batch(vocab, rows, dtype):
    rng, gen = random.Random(vocab), torch.Generator().manual_seed(vocab)
    logits, specs = random_logits(gen, rows, vocab, dtype), random_specs(rng, rows)
    want = [reference_sample(logits[i], specs[i]) for i in range(rows)]
    assert sample(logits, specs).tolist() == want  # all rows at once
    for _ in range(3):  # other compositions: a shuffled subset, each row among different neighbours
        order = rng.sample(range(rows), rng.randrange(1, rows + 1))
        assert sample(logits[order], [specs[i] for i in order]).tolist() == [want[i] for i in order]


def random_batch(rng, vocab):
    """Up to 6 sequences, each scoring some prompt rows, sampling a token, or both."""
    batch = Batch()
    for seq_id in range(rng.randrange(1, 7)):
        query = rng.randrange(1, 9)
        spec = random_specs(rng, 1)[0] if rng.random() < 0.8 else None
        room = query - (spec is not None)
        n_scored = rng.randrange(0 if spec is not None else 1, room + 1) if room else 0
        if spec is None and n_scored == 0:
            spec = random_specs(rng, 1)[0]
        scores = PromptScores([rng.randrange(vocab) for _ in range(n_scored)], rng.choice([0, 1, 3])) \
            if n_scored else None
        batch.add(seq_id, [1] * query, query, [3 * seq_id, 3 * seq_id + 1, 3 * seq_id + 2], 4, spec, scores)
    return batch


@pytest.mark.parametrize("vocab", [50, 1000])
def test_step_results_equal_the_per_sequence_reference(vocab):
    """Tokens, their logprobs and the scored prompt rows' logprobs (values and top entries) equal those computed
    sequence by sequence."""
    rng, gen = random.Random(vocab), torch.Generator().manual_seed(vocab)
    for _ in range(40):
        batch = random_batch(rng, vocab)
        logits = torch.randn(len(batch.logit_rows()), vocab, generator=gen) * 3
        assert step_results(batch, logits) == reference_step_results(batch, logits)


def test_top_p_is_compared_in_float32_as_the_reference_does():
    """An edge row: the mass before the second token is float32(0.9) exactly, which is below top_p = 0.9 only in
    float64. The reference compares in float32 and keeps one token: no seed draws the second, which 10% of draws
    would if it were kept."""
    logits = torch.tensor([[2.1972243785858154, 0.0]])
    probs = torch.softmax(logits[0], dim=-1)
    assert (probs.cumsum(0) - probs)[1] == torch.tensor(0.9)
    specs = [SampleSpec(1.0, 0.9, 0, seed=seed, index=0, logprobs=None) for seed in range(200)]
    assert {reference_sample(logits[0], spec) for spec in specs} == {0}
    assert set(sample(logits.expand(200, -1), specs).tolist()) == {0}
    kept_both = [SampleSpec(1.0, 1.0, 0, seed=seed, index=0, logprobs=None) for seed in range(200)]
    assert set(sample(logits.expand(200, -1), kept_both).tolist()) == {0, 1}


def test_samples_not_yet_forked_count_against_max_num_seqs():
    """A running request of n samples holds room for all n before they fork: later requests wait rather than
    leave its samples without room (a V4 cache has one sequence slot per --max-num-seqs)."""
    s = scheduler(max_num_seqs=4)
    s.add("p", list(range(10)), greedy(3, n=3), None)
    s.add("q", list(range(5)), greedy(3), None)
    s.add("r", list(range(5)), greedy(3), None)
    most = 0

    def seen(step):
        nonlocal most
        most = max(most, sum(r.seqs for r in s.ranks[0].running))

    outputs = run(s, seen)
    assert most <= 4 and set(outputs) == {"p", "q", "r"}
