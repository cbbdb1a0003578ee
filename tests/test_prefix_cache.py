"""Prefix caching at block granularity (runner/engine/block_pool.py, the scheduler's `_reuse_prefix`): a request
whose first full blocks another request has computed starts from them, and its tokens are the tokens computed from
scratch. V3.2 in float32 with the tiny indexer's index_topk of 8, so every context here is past it and the indexer
selects from cached keys too. DeepSeek-V4 (tiny: sliding window 16, CSA ratio 4, HCA ratio 128) also restores its
slot from state blocks (block_pool.StatePool, v4_cache.V4Cache.restore): hits inside the sliding window, in the
middle of an HCA window that the request then completes, and (block size 2) in the middle of a CSA window."""

import pytest
import torch

from dsconv.family.layout import Layout
from dsconv.runner.engine.block_pool import BlockPool, StatePool, block_hashes
from dsconv.runner.engine.request import SamplingParams
from dsconv.runner.models.dist import Dist
from dsconv.runner.models.registry import build_model
from dsconv.runner.models.weights import load_manifest
from tests.helpers import launch_ranks, run_config, shard
from tests.rank_entries import one_after_another
from dsconv.runner.engine.config import EngineConfig, SchedulerConfig
from dsconv.runner.engine.core import new_engine
from dsconv.runner.engine.request import SeqResult
from dsconv.runner.engine.scheduler import PoolShape, Scheduler
from dsconv.runner.models.v4_cache import V4Cache, entry_slots

NEW_TOKENS = 6


def engine(model, cache, max_num_seqs: int, budget: int, prefix_caching: bool = True, **parts):
    """dsrun's engine on one rank, stepped by the test through its scheduler (parts: new_engine's optional ones)."""
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                enable_prefix_caching=prefix_caching)
    return new_engine(model, cache, Dist(), EngineConfig(vocab_size=model.cfg.vocab_size, max_model_len=4096,
                                                         scheduler=scheduler), **parts)


def fake_results(step):
    """A 'model' for the scheduler alone: every sampling sequence draws token 1."""
    return [[SeqResult(None if spec is None else 1, None) for spec in batch.samples] for batch in step.batches]


# -- the pool ------------------------------------------------------------------------------------------------------

def test_hashes_chain_and_salt():
    tokens = list(range(40))
    plain = block_hashes(tokens, 16)
    assert len(plain) == 2 and block_hashes(tokens[:32], 16) == plain  # full blocks only; a prefix's are a prefix
    assert block_hashes(tokens, 16, known=plain[:1]) == plain  # extended from known ones
    assert block_hashes([99] + tokens[1:], 16)[1] != plain[1]  # block 1 depends on block 0's tokens (the chain)
    assert block_hashes(tokens, 16, salt="tenant-a") != plain  # a salt isolates
    assert block_hashes(tokens, 16, salt="tenant-a") == block_hashes(tokens, 16, salt="tenant-a")


def test_a_salt_cannot_alias_another_chain():
    """Issue 71: a salt whose UTF-8 bytes are a block's hash made a one-block chain hash as that block's child (the
    first block's hash began from the bare salt, a child's from its parent's hash)."""
    for first in range(100_000):  # a first block whose hash is valid UTF-8 (about one in a few hundred)
        parent = block_hashes([first] * 4, 4)[0]
        try:
            salt = parent.decode()
        except UnicodeDecodeError:
            continue
        break
    chain = block_hashes([first] * 4 + [7] * 4, 4)
    assert block_hashes([7] * 4, 4, salt=salt)[0] != chain[1]
    # and salts of other lengths never meet: "ab" + tokens and "a" + tokens differ even where the bytes would run on
    assert block_hashes([1] * 4, 4, salt="") != block_hashes([1] * 4, 4, salt="\x00")


def test_published_blocks_are_reused_then_evicted_least_recent_first():
    pool = BlockPool(4, 16)
    a, b = block_hashes(list(range(32)), 16), block_hashes(list(range(100, 132)), 16)
    pool.grow(1, 32)
    pool.publish(1, a)
    pool.release(1)  # published and unheld: still there, and still counted as free
    assert pool.num_free == 4 and pool.match(a) == [0, 1]
    pool.adopt(2, pool.match(a[:1]))
    assert pool.tables[2] == [0] and pool.num_free == 3
    pool.grow(3, 48)  # takes the never-used blocks 2, 3, then evicts block 1 (block 0 is held)
    assert pool.tables[3] == [2, 3, 1] and pool.match(a) == [0]
    pool.publish(3, b)
    pool.release(2)
    pool.release(3)
    assert pool.num_free == 4 and pool.match(b) == [2, 3]


def test_cache_aware_placement_weighs_the_hit_against_the_load():
    """Two DP ranks, blocks of 4: a 41-token prompt's 40 cached tokens on rank 0 draw a request with that prefix
    there while rank 0's extra load is below the 40 tokens the hit saves, and not once it is above; without prefix
    caching, or with another salt, the least-loaded rank."""
    def drained(s):
        while s.has_work:
            step = s.schedule()
            s.update(step, fake_results(step))

    prefix = list(range(100, 141))
    for balancing, caching, salt, extra, want in [("cache-aware", True, None, 30, 0), ("cache-aware", True, None, 50, 1),
                                                  ("cache-aware", True, "b", 30, 1), ("cache-aware", False, None, 30, 1),
                                                  ("least-loaded", True, None, 30, 1)]:
        s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, balancing=balancing),
                      PoolShape(dp=2, num_blocks=64, block_size=4, prefix_caching=caching))
        s.add("first", prefix, SamplingParams(max_tokens=1), lambda out: None, dp_rank=0)
        drained(s)
        s.add("load", list(range(extra)), SamplingParams(max_tokens=1), lambda out: None, dp_rank=0)  # queued on rank 0
        placed = s.add("second", prefix + [7], SamplingParams(max_tokens=1, cache_salt=salt), lambda out: None)
        assert placed.dp_rank == want, (balancing, caching, salt, extra)


def test_state_blocks_are_held_published_found_and_evicted():
    states = StatePool(4, 16)
    hashes = block_hashes(list(range(64)), 16)
    assert states.hold(1, 0, 20) == ((0, 0), (1, 1))  # blocks 0 and 1, each written from its first position
    assert states.hold(1, 20, 21) == ((1, 1),)  # the same block while it fills
    assert states.hold(2, 5, 40) == ((1, 2), (2, 3))  # block 0 joined at position 5: no state block for it
    assert states.hold(3, 0, 16) == ()  # nothing left
    states.publish(1, hashes[:1])  # block 0 full and computed: published, let go
    assert states.num_free == 1 and states.find(hashes[:1], 0) == [(0, 0)] and states.find(hashes[:2], 0) is None
    states.read(9, [0])  # a restore reads it: not given out meanwhile
    assert states.num_free == 0
    states.done_reading(9)
    states.release(1)  # block 1 unpublished: free again
    states.release(2)
    assert states.num_free == 4 and states.find(hashes[:1], 0) == [(0, 0)]
    assert states.hold(4, 0, 64) == ((0, 3), (1, 2), (2, 1), (3, 0))  # the free ones first, the published one last
    assert states.find(hashes[:1], 0) is None


# -- the engine at world 1 -----------------------------------------------------------------------------------------

def sharing(base: list[int], block_size: int, gen) -> list[tuple[list[int], int]]:
    """Prompts that share a prefix of `base` with the first one, and the prompt tokens each should find cached."""
    def tail(n):
        return torch.randint(2, 500, (n,), generator=gen).tolist()

    bs = block_size
    return [(base + tail(7), 0),  # the first: nothing cached yet
            (base[:bs + 3] + tail(9), bs),  # one block shared, the next one differs
            (base[:2 * bs + 1] + tail(2 * bs), 2 * bs),  # two blocks
            (base + tail(5), 3 * bs),  # many: every full block of the base
            (base[:3 * bs], 2 * bs),  # a prompt of whole blocks, all cached: its last token is computed again
            (base + tail(7), 3 * bs)]  # the first prompt again (its blocks past the base hold the first's tokens)


@pytest.fixture(scope="module")
def v32(tiny_source, tmp_path_factory):
    shards = tmp_path_factory.mktemp("prefix") / "w1"
    shard(tiny_source("deepseek_v32", "fp8"), shards, Layout(1, 1, 1, 1))
    model, _, new_cache = build_model(shards, load_manifest(shards), 0, Dist(), torch.float32)
    return shards, model, new_cache


def run_engine(model, new_cache, prompts, block_size, kv_cache_dtype, prefix_caching, budget=4096, cache_tokens=1024,
               max_num_seqs=4):
    """Each prompt after the one before has finished, on one engine -> (tokens, cached prompt tokens, scheduler)."""
    cache = new_cache(cache_tokens, kv_cache_dtype, block_size=block_size, max_seqs=max_num_seqs,
                      prefix_caching=prefix_caching)
    core = engine(model, cache, max_num_seqs, budget, prefix_caching)
    tokens, cached = one_by_one(core, prompts)
    return tokens, cached, core.scheduler


def one_by_one(core, prompts) -> tuple[list[list[int]], list[int]]:
    """Each prompt after the one before has finished, NEW_TOKENS each -> (tokens, cached prompt tokens) per
    prompt."""
    s, tokens, cached = core.scheduler, [], []
    for i, prompt in enumerate(prompts):
        s.add(str(i), prompt, SamplingParams(max_tokens=NEW_TOKENS), None)
        out_tokens = []
        while s.has_work:
            for _, out in core.step():
                out_tokens += out.new_token_ids
                cached_now = out.cached_tokens
        tokens.append(out_tokens)
        cached.append(cached_now)
    return tokens, cached


def test_a_request_that_fails_inside_the_engine_fails_alone(v32):
    """Issue 71: a cache_salt the prefix cache cannot hash (a lone surrogate, past the HTTP edge's own check) raised
    on the engine's thread, and rank 0 died with every request. Now a request whose admission (`add`) or whose
    step's results (`update`) raise fails alone with the reason, counted by stage, and the requests beside it get
    the tokens they get alone."""
    import prometheus_client

    from dsconv.runner.engine.core import EngineClient
    from dsconv.runner.engine.metrics import ServeMetrics

    _, model, new_cache = v32
    prompt = torch.randint(2, 500, (40,), generator=torch.Generator().manual_seed(71)).tolist()
    (alone,), _, _ = run_engine(model, new_cache, [prompt], 16, "auto", prefix_caching=True)
    metrics = ServeMetrics("tiny", 1)
    core = new_engine(model, new_cache(1024, "auto", block_size=16, max_seqs=4, prefix_caching=True), Dist(),
                      EngineConfig(vocab_size=model.cfg.vocab_size, max_model_len=4096,
                                   scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4096)),
                      metrics=metrics)
    take = core.scheduler.plan.finish_reason
    doomed = set()

    def finish_reason(request, token):  # a fault of one request's own, after its first step
        if request.request_id in doomed:
            raise RuntimeError("this request's own fault")
        return take(request, token)

    core.scheduler.plan.finish_reason = finish_reason
    door, outputs = EngineClient(), {}
    door.open(core)
    for name, salt in (("salt", "\ud800"), ("update", None), ("good", None)):
        request_id = door.submit(prompt, SamplingParams(max_tokens=NEW_TOKENS, cache_salt=salt),
                                 lambda out, name=name: outputs.setdefault(name, []).append(out))
        if name == "update":
            doomed.add(request_id)
    core.run(door, until_idle=True)
    for name, error in (("salt", "UnicodeEncodeError"), ("update", "this request's own fault")):
        (out,) = outputs[name]
        assert out.finished and out.finish_reason == "abort" and error in out.error, out
    assert [t for out in outputs["good"] for t in out.new_token_ids] == alone
    assert not core.scheduler.has_work and not core.scheduler.ranks[0].blocks.tables  # every block freed
    text = prometheus_client.generate_latest(metrics.registry).decode()
    for stage in ("add", "update"):
        assert f'dsrun:request_failures_total{{model_name="tiny",stage="{stage}"}} 1.0' in text, text


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_hits_give_the_tokens_computed_from_scratch(v32, block_size, kv_cache_dtype):
    _, model, new_cache = v32
    gen = torch.Generator().manual_seed(block_size)
    base = torch.randint(2, 500, (3 * block_size + 5,), generator=gen).tolist()
    cases = sharing(base, block_size, gen)
    prompts = [p for p, _ in cases]
    fresh, none_cached, _ = run_engine(model, new_cache, prompts, block_size, kv_cache_dtype, prefix_caching=False)
    got, cached, s = run_engine(model, new_cache, prompts, block_size, kv_cache_dtype, prefix_caching=True)
    assert all(len(t) == NEW_TOKENS for t in fresh) and not any(none_cached)
    assert got == fresh
    assert cached == [want for _, want in cases]
    assert s.prefix_hits == sum(cached) and s.prefix_queries == sum(map(len, prompts))


def test_chunked_prefill_publishes_only_computed_blocks_and_salts_isolate(v32):
    """A prompt of 70 tokens prefilled in chunks of 20 (the step budget): a second request with the same 70 tokens
    and 3 more arrives while it is still prefilling. It is admitted in the step where the first computes positions
    60 to 69, so of the 4 full blocks the two share it finds the 3 computed before (48 tokens). A request with
    another cache_salt finds none."""
    _, model, new_cache = v32
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(2, 500, (70,), generator=gen).tolist()
    core = engine(model, new_cache(1024, block_size=16), 4, 20)
    s, outs = core.scheduler, {}
    s.add("a", prompt, SamplingParams(max_tokens=NEW_TOKENS), None)
    core.step()  # 20 tokens: block 0 full and computed
    core.step()  # 40: blocks 0 and 1
    s.add("b", prompt + [7, 8, 9], SamplingParams(max_tokens=NEW_TOKENS), None)
    s.add("c", prompt, SamplingParams(max_tokens=NEW_TOKENS, cache_salt="other tenant"), None)
    while s.has_work:
        for request, out in core.step():
            outs.setdefault(request.request_id, [out.cached_tokens, []])[1].extend(out.new_token_ids)
    assert outs["b"][0] == 48 and outs["c"][0] == 0
    # each request looked up once, however many steps it waited at the head of the queue
    assert s.prefix_queries == 3 * len(prompt) + 3 and s.prefix_hits == 48
    alone, _, _ = run_engine(model, new_cache, [prompt, prompt + [7, 8, 9]], 16, "auto", prefix_caching=False)
    assert [outs["a"][1], outs["b"][1], outs["c"][1]] == [alone[0], alone[1], alone[0]]


@pytest.mark.slow
def test_world_16_hits_on_the_rank_that_holds_the_prefix(v32, tiny_source, tmp_path):
    """DP16 / EP16: the prompts one after another on attention-DP rank 3: the tokens of each prompt computed from
    scratch at world 1, and the cached tokens the world-1 run finds."""
    _, model, new_cache = v32
    gen = torch.Generator().manual_seed(16)
    base = torch.randint(2, 500, (3 * 16 + 5,), generator=gen).tolist()
    cases = sharing(base, 16, gen)
    prompts = [p for p, _ in cases]
    fresh, _, _ = run_engine(model, new_cache, prompts, 16, "auto", prefix_caching=False)
    shards = tmp_path / "w16"
    shard(tiny_source("deepseek_v32", "fp8"), shards, Layout(16, 16, 16, 1))
    run = run_config(shards, "float32", 1024, max_num_seqs=4, max_num_batched_tokens=4096)
    got = launch_ranks(one_after_another, {"prompts": prompts, "max_new_tokens": NEW_TOKENS, "dp_rank": 3}, run,
                       tmp_path / "results")
    assert got["generated"] == fresh
    assert got["cached"] == [want for _, want in cases]


def test_shared_blocks_are_never_written_while_held(v32):
    """Two requests share a published prefix of 2 blocks and run side by side, prefill and decode, next to a third
    that shares nothing: the shared blocks' latent rows and indexer keys, every layer, are the same bytes after as
    before, and the pool gets back to all blocks free."""
    _, model, new_cache = v32
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(2, 500, (40,), generator=gen).tolist()
    core = engine(model, new_cache(1024, block_size=16), 4, 4096)
    s = core.scheduler
    s.add("first", prefix, SamplingParams(max_tokens=2), None)
    while s.has_work:
        core.step()
    shared = s.ranks[0].blocks.match(block_hashes(prefix, 16)[:2])
    assert len(shared) == 2
    slots = torch.tensor([b * 16 + i for b in shared for i in range(16)])
    cache = core.worker.cache
    names = [name for name in ("c_kv_k_pe", "index_k") if name in cache.fields]

    def snapshot():
        return [cache.read_slots(layer, name, slots).clone() for layer in range(cache.layers) for name in names]

    before = snapshot()
    for i, tail in enumerate(([1, 2, 3], [4, 5, 6, 7, 8])):
        s.add(f"share{i}", prefix[:36] + tail, SamplingParams(max_tokens=NEW_TOKENS), None)
    s.add("other", torch.randint(2, 500, (30,), generator=gen).tolist(), SamplingParams(max_tokens=NEW_TOKENS), None)
    cached = {}
    while s.has_work:
        for request, out in core.step():
            cached[request.request_id] = out.cached_tokens
    assert cached == {"share0": 32, "share1": 32, "other": 0}
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot()))
    assert s.ranks[0].blocks.num_free == s.ranks[0].blocks.num_blocks


def test_a_pool_smaller_than_the_working_set_evicts_and_recomputes(v32):
    """A pool of 8 blocks of 16 and five 40-token prompts (3 blocks each with their output): the later prompts
    evict the earlier ones' published blocks, so the first prompt sent again finds less than it left, and every
    prompt gives the tokens computed from scratch."""
    _, model, new_cache = v32
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(2, 500, (40,), generator=gen).tolist() for _ in range(5)]
    prompts.append(prompts[0])
    fresh, _, _ = run_engine(model, new_cache, prompts, 16, "auto", prefix_caching=False)
    got, cached, s = run_engine(model, new_cache, prompts, 16, "auto", prefix_caching=True, cache_tokens=8 * 16)
    assert got == fresh
    assert cached[:5] == [0] * 5 and cached[5] < 32  # prompt 0's 2 full blocks: evicted, at least in part
    assert s.ranks[0].blocks.num_free == 8


# -- DeepSeek-V4 ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def v4(tiny_source, tmp_path_factory):
    shards = tmp_path_factory.mktemp("prefix-v4") / "w1"
    shard(tiny_source("deepseek_v4", "fp8"), shards, Layout(1, 1, 1, 1))
    model, _, new_cache = build_model(shards, load_manifest(shards), 0, Dist(), torch.float32)
    return shards, model, new_cache


def v4_sharing(base: list[int], block_size: int, gen) -> list[tuple[list[int], int]]:
    """Prompts sharing a prefix of a 300-token `base` with the first one, and the prompt tokens each should find
    cached. The tiny V4's HCA windows end at 128 and 256: the hits at 192 and at 256 - block_size fall inside the
    window 128 .. 255, which those requests then complete from the restored rows; every hit is past the first
    sliding window, whose keys before the hit come from the state blocks."""
    def tail(n):
        return torch.randint(2, 500, (n,), generator=gen).tolist()

    bs, first = block_size, base[:270] + tail(7)
    return [(first, 0),  # nothing cached yet
            (base[:bs + 3] + tail(9), bs),  # one block shared, the next one differs
            (base[:2 * bs + 1] + tail(2 * bs), 2 * bs),  # two blocks
            (base[:200] + tail(80), 192),  # many, ending mid-HCA-window: this one completes that window at 256
            (base[:256], 256 - bs),  # whole blocks, all cached: the last block is computed again, to 256
            (first, (len(first) - 1) // bs * bs)]  # the first again: every block its output filled too


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_v4_hits_give_the_tokens_computed_from_scratch(v4, block_size, kv_cache_dtype):
    _, model, new_cache = v4
    gen = torch.Generator().manual_seed(block_size)
    cases = v4_sharing(torch.randint(2, 500, (300,), generator=gen).tolist(), block_size, gen)
    prompts = [p for p, _ in cases]
    fresh, none_cached, _ = run_engine(model, new_cache, prompts, block_size, kv_cache_dtype, prefix_caching=False)
    got, cached, s = run_engine(model, new_cache, prompts, block_size, kv_cache_dtype, prefix_caching=True)
    assert all(len(t) == NEW_TOKENS for t in fresh) and not any(none_cached)
    assert got == fresh
    assert cached == [want for _, want in cases]
    states = s.ranks[0].states
    assert not states.held and not states.reading and states.num_free == states.num_blocks


def test_v4_hits_mid_csa_window(v4):
    """Blocks of 2 tokens: a boundary at 2 mod 4 leaves the CSA compressor's and the indexer's window half full, and
    their previous window's first series, to restore from state blocks that span blocks."""
    _, model, new_cache = v4
    gen = torch.Generator().manual_seed(2)
    base = torch.randint(2, 500, (40,), generator=gen).tolist()
    prompts = [base + [3, 4], base[:34] + [5, 6, 7], base[:30] + [8]]
    fresh, _, _ = run_engine(model, new_cache, prompts, 2, "auto", prefix_caching=False)
    got, cached, _ = run_engine(model, new_cache, prompts, 2, "auto", prefix_caching=True)
    assert got == fresh and cached == [0, 34, 30]
    assert [c % 4 for c in cached[1:]] == [2, 2]


def test_v4_hit_is_cut_back_to_the_boundary_whose_state_is_kept(v4):
    """A cache of 3 state blocks of 64 tokens: a 300-token prompt's one prefill step writes the state of its blocks
    0 to 2 and finds none left for blocks 3 and 4. Sent again, its 4 published blocks would give a hit at 256,
    whose restore needs the state from position 129 (blocks 2 and 3): the hit is cut back to 192 (blocks 1 and 2),
    and gives the same tokens."""
    _, model, _ = v4
    prompt = torch.randint(2, 500, (300,), generator=torch.Generator().manual_seed(4)).tolist()
    runs = {}
    for caching in (False, True):
        cache = V4Cache(model.cfg, 1024, torch.float32, block_size=64, max_seqs=1, state_blocks=3 * caching)
        core = engine(model, cache, 1, 4096, caching)
        runs[caching] = []
        for i in range(2):
            core.scheduler.add(str(i), prompt, SamplingParams(max_tokens=NEW_TOKENS), None)
            outs = [out for _ in iter(lambda: core.scheduler.has_work, False) for _, out in core.step()]
            runs[caching].append(([t for out in outs for t in out.new_token_ids], outs[-1].cached_tokens))
    assert runs[False] == [(runs[False][0][0], 0)] * 2
    assert runs[True] == [(runs[False][0][0], 0), (runs[False][0][0], 192)]
    assert len(core.scheduler.ranks[0].blocks.match(block_hashes(prompt, 64))) == 4


@pytest.mark.slow
def test_v4_world_16_hits_on_the_rank_that_holds_the_prefix(v4, tiny_source, tmp_path):
    """DeepSeek-V4 at DP16 / EP16 / lm_head TP16, INT8 cache: the V4 prompts one after another on attention-DP rank
    5, each restoring its slot from that rank's state blocks: the tokens computed from scratch at world 1, and the
    cached tokens found there."""
    _, model, new_cache = v4
    gen = torch.Generator().manual_seed(16)
    cases = v4_sharing(torch.randint(2, 500, (300,), generator=gen).tolist(), 16, gen)
    prompts = [p for p, _ in cases]
    fresh, _, _ = run_engine(model, new_cache, prompts, 16, "int8", prefix_caching=False)
    shards = tmp_path / "w16"
    shard(tiny_source("deepseek_v4", "fp8"), shards, Layout(16, 16, 16, 1))
    run = run_config(shards, "float32", 1024, kv_cache_dtype="int8", max_num_seqs=4)
    got = launch_ranks(one_after_another, {"prompts": prompts, "max_new_tokens": NEW_TOKENS, "dp_rank": 5}, run,
                       tmp_path / "results")
    assert got["generated"] == fresh
    assert got["cached"] == [want for _, want in cases]


def test_v4_shared_blocks_and_state_are_never_written_while_held(v4):
    """Two V4 requests share a published prefix of 8 blocks (past an HCA entry, 128) and run side by side, prefill
    and decode, next to a third that shares nothing: the shared blocks' compressed entries and indexer keys and the
    published state blocks they restored from, every layer, are the same bytes after as before."""
    _, model, new_cache = v4
    gen = torch.Generator().manual_seed(6)
    prefix = torch.randint(2, 500, (140,), generator=gen).tolist()
    core = engine(model, new_cache(2048, block_size=16), 4, 4096)
    s = core.scheduler
    s.add("first", prefix, SamplingParams(max_tokens=2), None)
    while s.has_work:
        core.step()
    hashes = block_hashes(prefix, 16)[:8]
    shared, published = s.ranks[0].blocks.match(hashes), [block for _, block in s.ranks[0].states.find(hashes, 0)]
    assert len(shared) == len(published) == 8
    cache = core.worker.cache

    def rows(tensor, blocks, per):  # a paged tensor's rows of these blocks, `per` rows per block
        return tensor[torch.tensor([b * per + i for b in blocks for i in range(per)])].clone()

    def snapshot():
        entries = [rows(t, shared, entry_slots(c.ratio, 16))
                   for layer in cache.layers for c in layer.compressors() for t in c.entries.tensors()]
        return entries + [rows(t, published, t.shape[0] // cache.state_blocks)
                          for layer in cache.layers for t in layer.state.tensors()]

    before = snapshot()
    for i, tail in enumerate(([1, 2, 3], [4, 5, 6, 7, 8])):
        s.add(f"share{i}", prefix[:136] + tail, SamplingParams(max_tokens=NEW_TOKENS), None)
    s.add("other", torch.randint(2, 500, (30,), generator=gen).tolist(), SamplingParams(max_tokens=NEW_TOKENS), None)
    cached = {}
    while s.has_work:
        for request, out in core.step():
            cached[request.request_id] = out.cached_tokens
    assert cached == {"share0": 128, "share1": 128, "other": 0}
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(), strict=True))
    assert s.ranks[0].blocks.num_free == s.ranks[0].blocks.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_context_parallel_prefill_computes_only_the_uncached_tail(v32, tiny_source, tmp_path, kv_cache_dtype):
    """DP2 with a context-parallel group of both ranks: each prompt is prefilled by the group, a later one only past
    its prefix hit, with the owner's cached entries (INT8 as stored) sent to the other member in each layer: the
    tokens computed from scratch at world 1, without context parallelism."""
    _, model, new_cache = v32
    gen = torch.Generator().manual_seed(2)
    first = torch.randint(2, 500, (53,), generator=gen).tolist()
    prompts = [first, first[:40] + torch.randint(2, 500, (25,), generator=gen).tolist(), first + [1, 2]]
    fresh, _, _ = run_engine(model, new_cache, prompts, 16, kv_cache_dtype, prefix_caching=False)
    shards = tmp_path / "w2"
    shard(tiny_source("deepseek_v32", "fp8"), shards, Layout(2, 2, 2, 1))
    run = run_config(shards, "float32", 1024, kv_cache_dtype=kv_cache_dtype, cp_size=2, cp_min_tokens=4)
    got = launch_ranks(one_after_another, {"prompts": prompts, "max_new_tokens": NEW_TOKENS}, run,
                       tmp_path / "results")
    assert got["generated"] == fresh
    assert got["cached"] == [0, 32, 48] and got["cp_prefills"] == 3
