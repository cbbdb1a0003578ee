"""Context-parallel prefill (--prefill-context-parallel-size): the causal-balanced split of a prompt, the scheduler's
shares, and the sharded runs: float32 greedy tokens equal transformers' at world 16 with groups of 2, 4 and 16,
perplexity equal to a run without it, and a server prefilling a long prompt by CP beside short ones."""

import threading

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from dsconv.errors import InputError
from dsconv.family.arch import check_context_parallel, families
from dsconv.family.layout import Layout
from dsconv.runner.engine.request import SamplingParams, SeqResult, TokenLogprob
from dsconv.runner.engine.config import SchedulerConfig
from dsconv.runner.engine.scheduler import PoolShape, Scheduler
from dsconv.runner.engine.batch import cp_positions
from tests.helpers import Server, generate_ranks, score_ranks, shard, stable_index_ties

NEW_TOKENS = 6
MIN_TOKENS = 4  # prompts this long or longer are prefilled by CP in these tests

REPLY_S = 300  # the longest a streamed first token may take on 2 busy cores


# -- the split -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("length,size", [(37, 2), (37, 4), (5, 16), (1, 2), (64, 4), (4096, 16)])
def test_split_covers_the_prompt_once_and_gives_the_owner_its_last_position(length, size):
    shares = [cp_positions(length, size, member) for member in range(size)]
    assert sorted(p for share in shares for p in share) == list(range(length))
    assert all(share == sorted(share) for share in shares) and length - 1 in shares[0]


def test_split_balances_causal_work():
    """The work of a query is its position + 1 keys: pairing chunk i with chunk 2N - 1 - i evens it out, where
    N contiguous slices would leave the last member with most of it."""
    length, size = 4096, 4
    work = [sum(p + 1 for p in cp_positions(length, size, member)) for member in range(size)]
    contiguous = [sum(range(m * length // size + 1, (m + 1) * length // size + 1)) for m in range(size)]
    assert max(work) / min(work) < 1.01 and max(contiguous) / min(contiguous) > 5


# -- the scheduler ---------------------------------------------------------------------------------------------

def scheduler(dp=4, cp_size=2, **kwargs):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, cp_size=cp_size,
                                     cp_min_tokens=MIN_TOKENS),
                     PoolShape(dp=dp, num_blocks=64, block_size=4, **kwargs))


def test_a_long_prompt_takes_its_groups_step():
    s = scheduler()
    long = s.add("long", list(range(10, 20)), SamplingParams(max_tokens=2), None, dp_rank=1)
    s.add("short", [1, 2], SamplingParams(max_tokens=2), None, dp_rank=0)
    s.add("other", list(range(30, 40)), SamplingParams(max_tokens=2), None, dp_rank=2)
    step = s.schedule()
    shares = [b.cp for b in step.batches]
    # group (0, 1): rank 1 owns the prompt, rank 0 gives its step; group (2, 3): rank 2 owns "other"
    assert [(c.group, c.member) for c in shares] == [((1, 0), 1), ((1, 0), 0), ((2, 3), 0), ((2, 3), 1)]
    assert [b.input_ids for b in step.batches[:2]] == [[10 + p for p in cp_positions(10, 2, 1)],
                                                       [10 + p for p in cp_positions(10, 2, 0)]]
    assert shares[1].sample is not None and shares[0].sample is None and len(shares[1].block_table) == 3
    assert long.num_computed == 10 and s.cp_prefills == 2
    results = [[SeqResult(None, None)], [SeqResult(77, None)], [SeqResult(88, None)], [SeqResult(None, None)]]
    outputs = {request.request_id: out.new_token_ids for request, out in s.update(step, results)}
    assert outputs == {"long": [77], "other": [88]}
    step = s.schedule()  # the short prompt runs now, beside the decodes
    assert [b.cp for b in step.batches] == [None] * 4 and step.batches[0].input_ids == [1, 2]


def test_prompt_scores_come_back_in_position_order():
    s = scheduler(dp=2)
    s.add("score", list(range(10, 21)), SamplingParams(max_tokens=0, prompt_logprobs=0), None, dp_rank=0)
    step = s.schedule()
    results = []
    for batch in step.batches:
        share = batch.cp
        scored = [p for p in share.positions if p < share.length - 1]
        assert share.scores.targets == [10 + p + 1 for p in scored]
        results.append([SeqResult(None, None, [TokenLogprob(10 + p + 1, -float(p)) for p in scored])])
    [(_, out)] = s.update(step, results)
    assert out.finished and [e.logprob for e in out.prompt_logprobs[1:]] == [-float(p) for p in range(10)]


def results_of(step, token=5) -> list[list[SeqResult]]:
    """A 'model' that draws `token` for every sequence that samples; a context-parallel share is one result per
    member, its owner's drawing."""
    results = []
    for batch in step.batches:
        if batch.cp is not None:
            results.append([SeqResult(token if batch.cp.sample is not None else None, None)])
        else:
            results.append([SeqResult(token if spec is not None else None, None) for spec in batch.samples])
    return results


def test_short_prompts_and_recomputed_requests_are_not_split():
    s = scheduler()
    s.add("short", [1, 2, 3], SamplingParams(max_tokens=2), None, dp_rank=0)
    assert [b.cp for b in s.schedule().batches] == [None] * 4

    # A long prompt prefilled by its group, preempted once it has generated: recomputed (prompt and output) on its
    # own rank alone. 4 blocks of 4 tokens per DP rank hold "first" (3 + 10) or "long" (10 + 3), not both.
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, cp_size=2, cp_min_tokens=MIN_TOKENS),
                  PoolShape(dp=2, num_blocks=4, block_size=4))
    s.add("first", [1, 2, 3], SamplingParams(max_tokens=10), None, dp_rank=0)
    step = s.schedule()
    s.update(step, results_of(step))
    long = s.add("long", list(range(10, 20)), SamplingParams(max_tokens=3), None, dp_rank=0)
    step = s.schedule()
    assert [b.cp is not None for b in step.batches] == [True, True]  # its group's prefill
    s.update(step, results_of(step))
    assert long.output == [5]
    recomputed = 0
    while s.has_work:
        step = s.schedule()
        if long.num_computed == 0 and long.output:  # preempted after its first token: waiting to be recomputed
            recomputed += 1
        assert all(b.cp is None for b in step.batches)
        s.update(step, results_of(step))
    assert recomputed and s.preemptions >= 1 and s.cp_prefills == 1
    assert long.output == [5, 5, 5]


def test_refusals_in_one_line():
    v32, v4 = families()["deepseek_v32"], families()["deepseek_v4"]
    with pytest.raises(InputError, match="not available for deepseek_v4: its compressed entries pool windows"):
        check_context_parallel(v4, Layout(16, ep=16, tp=16), 2, 2048)
    with pytest.raises(InputError, match="needs attention TP 1 and an attention-DP size it divides"):
        check_context_parallel(v32, Layout(16, ep=16, tp=16, attn_tp=8), 2, 2048)
    with pytest.raises(InputError, match="needs attention TP 1 and an attention-DP size it divides"):
        check_context_parallel(v32, Layout(16, ep=16, tp=16), 3, 2048)
    with pytest.raises(InputError, match="must be at least 1"):
        check_context_parallel(v32, Layout(16, ep=16, tp=16), 2, 0)
    check_context_parallel(v4, Layout(16, ep=16, tp=16), 1, 2048)  # CP off: nothing to refuse


# -- sharded runs ----------------------------------------------------------------------------------------------

# a prompt longer than several index_topk (8), lengths that do not divide by 2N, one shorter than a group of 16,
# and one under MIN_TOKENS that is not split
PROMPTS = [list(range(100, 137)), [42 + i for i in range(23)], [7, 8, 9], [300 + 7 * i for i in range(5)],
           [900 - i for i in range(33)]]


def generate(shards, tmp_path, name, **extra) -> tuple[list[list[int]], int]:
    result = generate_ranks(shards, tmp_path / name, PROMPTS, "float32", NEW_TOKENS, **extra)
    return result["generated"], result["cp_prefills"]


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_at_world_16(tiny_source, tmp_path):
    shards = tmp_path / "w16"
    shard(tiny_source("deepseek_v32", "fp8"), shards, Layout(16, 16, 16, 1))
    reference = AutoModelForCausalLM.from_pretrained(tiny_source("deepseek_v32", "bf16"), dtype=torch.float32).eval()
    with torch.no_grad(), stable_index_ties():
        expected = [reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist() for ids in PROMPTS]
    for size in (2, 4, 16):
        tokens, prefills = generate(shards, tmp_path, f"cp{size}", cp_size=size, cp_min_tokens=MIN_TOKENS)
        assert prefills == sum(len(p) >= MIN_TOKENS for p in PROMPTS)
        assert tokens == expected, size


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_perplexity_equals_the_run_without_cp(tiny_source, tmp_path, kv_cache_dtype):
    """With the INT8 cache too: the scratch a member attends over stores the gathered entries as the cache does."""
    shards = tmp_path / "w2"
    shard(tiny_source("deepseek_v32", "fp8"), shards, Layout(2, 2, 2, 1))
    windows = [[0] + list(range(200, 260)), [0] + list(range(500, 530)), [0, 5, 6]]
    scores = {}
    for size in (1, 2):
        scores[size] = score_ranks(shards, tmp_path / f"ppl-cp{size}", windows, kv_cache_dtype=kv_cache_dtype,
                                   cp_size=size, cp_min_tokens=MIN_TOKENS)
    assert scores[2]["context_parallel_prefills"] == 2 and scores[1]["context_parallel_prefills"] == 0
    assert scores[2]["tokens"] == scores[1]["tokens"]
    assert abs(scores[2]["perplexity"] / scores[1]["perplexity"] - 1) < 1e-4, scores


@pytest.mark.slow
def test_server_prefills_a_long_prompt_by_cp_beside_short_ones(tiny_source, tmp_path):
    shards = tmp_path / "serve"
    shard(tiny_source("deepseek_v32", "fp8"), shards, Layout(2, 2, 2, 1))
    # without prefix caching: the long prompt's second run would otherwise find its blocks and prefill only the
    # 16 tokens past them, by chunks (tests/test_prefix_cache.py has CP with cached prefixes)
    server = Server(shards, tmp_path / "serve.log", "--dtype", "float32", "--prefill-context-parallel-size", "2",
                    "--prefill-cp-min-tokens", "32", "--max-num-batched-tokens", "16", "--no-enable-prefix-caching")
    try:
        client = server.openai()
        model = client.models.list().data[0].id
        prompts = [list(range(300, 380)), [5, 6, 7], list(range(40, 52)), [9] * 7]

        def complete(prompt, decoding: threading.Event | None = None):
            """The prompt's 8 greedy tokens, streamed; `decoding` is set once the first has arrived."""
            tokens = []
            for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.0,
                                                   stream=True, logprobs=0,
                                                   extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}):
                tokens += [int(t.split(":")[1]) for t in chunk.choices[0].logprobs.tokens]
                if decoding is not None:
                    decoding.set()
            return tokens

        alone = [complete(p) for p in prompts]
        together = [None] * len(prompts)
        # The short requests start first, and the long one is sent once each of them has its first token: it then
        # waits alone, at the head of its rank's queue, and its whole prompt is prefilled by CP while the others
        # decode. Sent at the same time, a short prompt queued ahead of it on its rank would start it by chunks,
        # depending on arrival order.
        decoding = [threading.Event() for _ in prompts[1:]]

        def run(i):
            together[i] = complete(prompts[i], decoding[i - 1] if i else None)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(1, len(prompts))]
        for thread in threads:
            thread.start()
        for event in decoding:
            assert event.wait(timeout=REPLY_S)
        threads.append(threading.Thread(target=run, args=(0,)))
        threads[-1].start()
        for thread in threads:
            thread.join()
        assert together == alone
        metrics = httpx.get(f"{server.url}/metrics").text
        prefills = [line for line in metrics.splitlines() if line.startswith("dsrun:context_parallel_prefills_total")]
        assert prefills and float(prefills[0].split()[-1]) == 2  # the long prompt, alone and together
    finally:
        assert server.stop() == 0, server.log()
