"""The V4 runner against transformers' DeepseekV4ForCausalLM on the same weights: the one-sequence prefill,
greedy tokens through the step function and its paged cache, steps of any size against one whole forward,
and the same tokens sharded over 16 ranks."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from dsconv.family.deepseek_v4 import AttnType, parse_config
from dsconv.errors import InputError
from dsconv.runner.models import step as step_module
from dsconv.runner.engine.config import EngineConfig, SchedulerConfig
from dsconv.runner.engine.core import new_engine
from dsconv.runner.engine.request import SamplingParams
from dsconv.runner.engine.batch import Batch
from dsconv.runner.models.v4_cache import V4Cache
from dsconv.runner.models.dist import Dist
from tests.helpers import greedy
from dsconv.runner.models.deepseek_v4 import DeepseekV4
from dsconv.runner.models.weights import load_manifest, load_rank
from dsconv.family.layout import Layout
from tests.helpers import (NEW_TOKENS as DIST_NEW_TOKENS, Recorder, Steps, cosine, forward_full, last_rows, run_ranks,
                           shard)

COSINE_MIN = 0.999
# The tiny config's sliding_window is 16, its compress rates 4 and 128, its index_topk 8: 300 tokens cross
# 18 windows, give CSA layers 75 entries to choose 8 from and HCA layers 2 complete windows
PROMPT_LEN = 300
# Generation: a 240-token prompt holds 15 sliding windows, 60 CSA entries and one HCA entry; the 20 decoded
# tokens cross another window and complete the second HCA entry (at 256) and 5 CSA entries
GEN_PROMPT_LEN = 240
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def pair(tiny_source, tmp_path_factory):
    """(our model, its config, transformers' model) on identical float32 weights."""
    shards = tmp_path_factory.mktemp("deepseek_v4-bf16-shards") / "s"
    shard(tiny_source("deepseek_v4", "fp8"), shards, Layout(1, 1, 1, 1))
    reference = AutoModelForCausalLM.from_pretrained(tiny_source("deepseek_v4", "bf16"), dtype=torch.float32).eval()
    manifest = load_manifest(shards)
    cfg = parse_config(manifest["model"]["config"])
    model = DeepseekV4(cfg, load_rank(shards, manifest, 0), Dist(), torch.float32)
    return model, cfg, reference, shards


def test_fixture_schedule_has_every_attention_type(pair):
    _, cfg, _, _ = pair
    assert set(cfg.attn_types) == set(AttnType)
    assert PROMPT_LEN > cfg.hca_compress_rate * 2 and PROMPT_LEN // cfg.csa_compress_rate > cfg.index_topk


def test_prefill_hidden_states_and_logits(pair):
    model, cfg, reference, _ = pair
    ids = torch.randint(2, cfg.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = reference(ids[None], output_hidden_states=True)
        hidden, blocks = [], model.layers  # each block's output streams, as the model runs
        model.layers = [Recorder(block, hidden) for block in blocks]
        try:
            logits = forward_full(model, ids)
        finally:
            model.layers = blocks
    # transformers: the embedding's hc_mult copies, then each layer's streams [T, hc_mult, hidden] but the
    # last layer's, whose place holds the final norm's output
    assert len(ref.hidden_states) == cfg.num_hidden_layers + 1
    assert len(hidden) == cfg.num_hidden_layers
    for layer, (mine, theirs) in enumerate(zip(hidden[:-1], ref.hidden_states[1:-1])):
        assert mine.shape == theirs[0].shape == (PROMPT_LEN, cfg.hc_mult, cfg.hidden_size)
        assert cosine(mine, theirs[0]) >= COSINE_MIN, layer
    with torch.no_grad():
        final = model.norm(model.hc_head(hidden[-1]))  # the last layer, seen through hc_head and the norm
    assert cosine(final, ref.hidden_states[-1][0]) >= COSINE_MIN
    assert cosine(logits, ref.logits[0]) >= COSINE_MIN


def test_mtp_tensors_are_dropped_and_nothing_is_left(tiny_source, tmp_path):
    shards = tmp_path / "s"
    shard(tiny_source("deepseek_v4", "fp8"), shards, Layout(1, 1, 1, 1))
    manifest = load_manifest(shards)
    weights = load_rank(shards, manifest, 0)
    assert any(name.startswith("mtp.") for name in weights.tensors)
    DeepseekV4(parse_config(manifest["model"]["config"]), weights, Dist(), torch.float32)
    assert not weights.tensors


def prompt(vocab, n, seed):
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


BLOCK_SIZES = [16, 64]  # the default, and one past the sliding window and several CSA windows


@pytest.mark.parametrize("block_size,prefill_scores",
                         [(size, None) for size in BLOCK_SIZES] + [(BLOCK_SIZES[0], 1)])
def test_greedy_tokens_equal_transformers_generate(pair, block_size, prefill_scores, monkeypatch):
    """prefill_scores 1: the prefill's attention and index scores taken one query at a time (step.PREFILL_SCORES
    bounds them)."""
    if prefill_scores is not None:
        monkeypatch.setattr(step_module, "PREFILL_SCORES", prefill_scores)
    model, cfg, reference, _ = pair
    ids = prompt(cfg.vocab_size, GEN_PROMPT_LEN, seed=1)
    with torch.no_grad():
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        got = greedy(model, V4Cache(cfg, 512, torch.float32, block_size=block_size), [ids], NEW_TOKENS,
                     eos_id=None)[0]
    assert GEN_PROMPT_LEN < 2 * cfg.hca_compress_rate <= GEN_PROMPT_LEN + NEW_TOKENS
    assert got == expected


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_steps_of_any_size_equal_one_whole_forward(pair, block_size):
    """A sequence fed in uneven chunks (one token, a partial window, several whole windows) continues its
    cache exactly: each chunk's logits equal the same rows of one forward over the whole sequence."""
    model, cfg, _, _ = pair
    ids = torch.tensor(prompt(cfg.vocab_size, 2 * cfg.hca_compress_rate + 5, seed=3))
    chunks = [1, 3, 2 * cfg.csa_compress_rate + 1, cfg.sliding_window + 7, cfg.hca_compress_rate, 1, 1]
    chunks.append(ids.shape[0] - sum(chunks))
    runner = Steps(V4Cache(cfg, ids.shape[0], torch.float32, block_size=block_size))
    with torch.no_grad():
        whole = forward_full(model, ids)
        stepped = []
        for start, n in zip(torch.tensor([0, *chunks]).cumsum(0).tolist(), chunks):
            stepped.append(runner.forward(model, [(0, ids[start:start + n].tolist())]))
    assert torch.allclose(torch.cat(stepped), whole, atol=1e-4, rtol=0)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_sequences_with_different_chunks_in_the_same_steps(pair, block_size):
    """Two sequences share every step, each with its own chunk sizes and state (one of them idle for a step):
    each one's logits equal its own whole forward."""
    model, cfg, _, _ = pair
    ids = [torch.tensor(prompt(cfg.vocab_size, n, seed=n)) for n in (37, cfg.hca_compress_rate + 22)]
    chunks = [(30, 3), (1, cfg.hca_compress_rate), (0, 2), (6, 17)]  # (first, second) new tokens per step
    runner = Steps(V4Cache(cfg, 512, torch.float32, block_size=block_size))
    got, done = [[], []], [0, 0]
    with torch.no_grad():
        for step in chunks:  # an idle sequence is not in the step's batch, as the scheduler leaves it out
            inputs = runner.inputs([(seq, ids[seq][done[seq]:done[seq] + n].tolist()) for seq, n in enumerate(step)
                                    if n])
            logits = model.forward(inputs.tokens, inputs.meta, runner.cache)
            rows = {s.seq_id: (s.start, s.stop) for s in inputs.meta.seqs}
            for seq, n in enumerate(step):
                start, stop = rows.get(seq, (0, 0))
                got[seq].append(logits[start:stop])
                done[seq] += n
        for seq in range(2):
            assert done[seq] == ids[seq].shape[0]
            assert torch.allclose(torch.cat(got[seq]), forward_full(model, ids[seq]), atol=1e-4, rtol=0)


def test_finished_sequences_give_their_room_back(pair):
    """Generation releases a sequence's state when it stops, so the cache only has to hold what is running."""
    model, cfg, _, _ = pair
    cache = V4Cache(cfg, 64, torch.float32)
    with torch.no_grad():
        first = greedy(model, cache, [prompt(cfg.vocab_size, 40, seed=4)], 8, eos_id=None)
        assert not cache.slots and not cache.lengths and len(cache.free_slots) == cache.max_seqs
        greedy(model, cache, [prompt(cfg.vocab_size, 50, seed=5)], 8, eos_id=None)  # 58 of 64 fits only now
    assert len(first[0]) == 8


def test_batched_step_equals_each_sequence_alone(pair):
    model, cfg, _, _ = pair
    prompts = [prompt(cfg.vocab_size, n, seed=n) for n in (5, 23, 40)]
    with torch.no_grad():
        alone = [greedy(model, V4Cache(cfg, 256, torch.float32), [p], 6, eos_id=None)[0] for p in prompts]
        assert greedy(model, V4Cache(cfg, 256, torch.float32), prompts, 6, eos_id=None) == alone
        # the prefill logits too, not only the argmax
        batched = Steps(V4Cache(cfg, 256, torch.float32)).forward(model, list(enumerate(prompts)))
        assert torch.allclose(batched, torch.cat([forward_full(model, torch.tensor(p)) for p in prompts]), atol=1e-4,
                              rtol=0)
        empty = Steps(V4Cache(cfg, 16, torch.float32))  # a rank without sequences still runs the step, zero rows
        assert empty.forward(model, []).shape == (0, cfg.vocab_size)


@pytest.mark.parametrize("gather_rows,block_size", [(step_module.DECODE_GATHER_ROWS, 16), (16, 16),
                                                    (step_module.DECODE_GATHER_ROWS, 64)],
                         ids=["one-group", "groups", "one-group-block-64"])
def test_decodes_beside_prefills_equal_each_alone(pair, gather_rows, block_size, monkeypatch):
    """Steps whose one-row sequences (attended together, keys padded to the longest) sit between prefill
    chunks: each sequence's logits at every step equal its own run and its whole forward (the prefill path).

    After their prompts, six sequences decode five tokens together. At the first decode they hold 0, 1, 8
    (index_topk: the token completes a window), 15, 32 and 64 CSA entries; three complete a CSA window in the
    same step, and again four steps later from the state that batched pooling left; two complete an HCA entry
    (positions 127 and 255) in the same step. 16 gather rows split the CSA decodes into groups, one of them
    holding two sequences."""
    monkeypatch.setattr(step_module, "DECODE_GATHER_ROWS", gather_rows)
    model, cfg, _, _ = pair
    ratio, hca = cfg.csa_compress_rate, cfg.hca_compress_rate
    lengths = (2, 5, ratio * cfg.index_topk - 1, 60, hca - 1, 2 * hca - 1)
    prompts = {seq: prompt(cfg.vocab_size, n, seed=n) for seq, n in enumerate(lengths)}
    fresh, other = prompt(cfg.vocab_size, 17, seed=17), prompt(cfg.vocab_size, 11, seed=11)
    steps = [list(prompts.items()),
             [(10, fresh), (0, [7]), (1, [8]), (11, other), *((seq, [9 + seq]) for seq in range(2, 6))],
             *([(seq, [20 + 6 * step + seq]) for seq in (0, 1, 2, 10, 3, 4, 5)] for step in range(ratio))]

    def run(steps):
        """Runs steps of (seq_id, tokens) on a new cache -> per step, each sequence's last-row logits."""
        runner, out = Steps(V4Cache(cfg, 1024, torch.float32, block_size=block_size)), []
        for step in steps:
            inputs = runner.inputs(step)
            with torch.no_grad():
                logits = model.forward(inputs.tokens, inputs.meta, runner.cache, rows=last_rows(inputs.meta))
            out.append({seq_id: logits[i] for i, (seq_id, _) in enumerate(step)})
        return out

    together = run(steps)
    for seq_id in (*prompts, 10):
        own = [(i, tokens) for i, step in enumerate(steps) for s, tokens in step if s == seq_id]  # (step, tokens)
        alone = run([[(seq_id, tokens)] for _, tokens in own])
        for (i, _), logits in zip(own, alone):
            torch.testing.assert_close(together[i][seq_id], logits[seq_id], rtol=1e-5, atol=1e-5)
        with torch.no_grad():  # the last step against the whole sequence's forward
            whole = forward_full(model, torch.tensor([t for _, tokens in own for t in tokens]))[-1]
        torch.testing.assert_close(together[own[-1][0]][seq_id], whole, rtol=0, atol=1e-4)


def test_cache_capacity_and_release(pair):
    """The cache's room is the block pool's, in whole blocks (16 tokens here: one block); releasing a sequence
    frees its blocks and its sequence slot."""
    _, cfg, _, _ = pair
    runner = Steps(V4Cache(cfg, 16, torch.float32))
    runner.inputs([(0, [2] * 6)])
    with pytest.raises(InputError, match="holds 16 tokens; sequence 1 needs 5"):
        runner.inputs([(1, [2] * 5)])
    runner.release(0)
    runner.inputs([(1, [2] * 5)])
    assert list(runner.cache.slots) == [1] and len(runner.cache.free_slots) == runner.cache.max_seqs - 1


@pytest.mark.slow
def test_world_16_same_tokens_as_transformers(pair, tiny_source, tmp_path):
    """EP16 + lm_head TP16 through dsrun's rank_main, in blocks of 64 tokens (world 16's other V4 runs use the
    default 16), three prompts of different lengths on different attention-DP ranks (13 ranks have none and run
    zero-token steps); the longest completes an HCA entry and crosses 8 sliding windows and two blocks, the
    shortest no CSA window before decoding: each one's tokens equal transformers'. With --kv-cache-dtype int8 (and
    the shared experts after the exchange, --no-overlap-shared-experts) they equal the INT8 cache's at world 1."""
    model, cfg, reference, _ = pair
    prompts = [prompt(cfg.vocab_size, n, seed=n) for n in (3, cfg.hca_compress_rate + 2, 20)]
    shards = tmp_path / "w16"
    shard(tiny_source("deepseek_v4", "fp8"), shards, Layout(16, 16, 16, 1))
    got = run_ranks(shards, tmp_path, prompts, block_size=64)
    with torch.no_grad():
        want = [reference.generate(torch.tensor([p]), max_new_tokens=DIST_NEW_TOKENS, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert all(len(t) == DIST_NEW_TOKENS for t in want)
    assert got == want
    got = run_ranks(shards, tmp_path, prompts, block_size=64, kv_cache_dtype="int8", results_name="int8",
                    overlap_shared_experts=False)
    with torch.no_grad():
        want = greedy(model, V4Cache(cfg, 256, torch.float32, block_size=64, kv_cache_dtype="int8"), prompts,
                      DIST_NEW_TOKENS, eos_id=None)
    assert got == want


# What docs/v4.md reports for this fixture: logits cosine 0.99917, greedy tokens equal to BF16's for the first
# 17 of 20 (asserted with a margin: random weights leave near-ties between top tokens).
W8A8_COSINE_MIN = 0.999
W8A8_AGREEMENT_MIN = 14


def test_w8a8_logits_close_to_bf16(pair, w8a8_source, tmp_path):
    """dsconv's W8A8 output of the FP8 + FP4 fixture against the BF16 path, both computed in float32, over a
    prompt that reaches every layer type's compressed entries, and greedy agreement over 20 tokens."""
    model, cfg, _, _ = pair
    shards = tmp_path / "w8a8-shards"
    shard(w8a8_source("deepseek_v4"), shards, Layout(1, 1, 1, 1))
    manifest = load_manifest(shards)
    assert manifest["precision"] == "w8a8"
    w8a8 = DeepseekV4(cfg, load_rank(shards, manifest, 0), Dist(), torch.float32)
    assert w8a8.layers[2].ffn.experts.int8  # the experts really run W8A8
    ids = prompt(cfg.vocab_size, PROMPT_LEN, seed=2)
    with torch.no_grad():
        similarity = cosine(forward_full(w8a8, torch.tensor(ids)), forward_full(model, torch.tensor(ids)))
        got = greedy(w8a8, V4Cache(cfg, 512, torch.float32), [ids], NEW_TOKENS, eos_id=None)[0]
        want = greedy(model, V4Cache(cfg, 512, torch.float32), [ids], NEW_TOKENS, eos_id=None)[0]
    agree = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), NEW_TOKENS)
    print(f"deepseek_v4 W8A8 vs BF16 logits cosine over {len(ids)} positions: {similarity:.5f}; greedy tokens "
          f"equal for the first {agree} of {NEW_TOKENS} ({sum(a == b for a, b in zip(got, want))} positionwise)")
    assert similarity >= W8A8_COSINE_MIN
    assert agree >= W8A8_AGREEMENT_MIN


def _tensors(obj, seen=None) -> dict[int, torch.Tensor]:
    """Every tensor reachable from obj's attributes, lists and dicts, by id."""
    seen = {} if seen is None else seen
    if isinstance(obj, torch.Tensor):
        seen[id(obj)] = obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _tensors(item, seen)
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensors(item, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for item in vars(obj).values():
            _tensors(item, seen)
    return seen


def test_cache_storage_is_allocated_once_and_the_pool_empties(pair):
    """The engine runs two requests of n = 2 samples (forked caches sharing full blocks) in a cache too small for
    all (preemption): after every step the cache holds exactly the tensors it allocated at start-up, at the same
    addresses, and once all finish every block and sequence slot is free again."""
    model, cfg, _, _ = pair
    cache = V4Cache(cfg, 96, torch.float32, max_seqs=4)
    allocated = {id(t): t.data_ptr() for t in cache.tensors()}
    assert {id(t) for t in _tensors(cache).values()} == set(allocated)
    core = new_engine(model, cache, Dist(), EngineConfig(
        vocab_size=cfg.vocab_size, max_model_len=4096,
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24)))
    s = core.scheduler
    for i, n in enumerate((21, 30)):
        s.add(str(i), prompt(cfg.vocab_size, n, seed=n), SamplingParams(max_tokens=12, temperature=1.0, seed=i, n=2),
              None)
    finished = 0
    while s.has_work:
        finished += sum(out.finished for _, out in core.step())
        live = _tensors(cache)
        assert {i: t.data_ptr() for i, t in live.items()} == allocated
    assert finished == 4 and s.preemptions > 0
    pool = s.ranks[0].blocks
    assert pool.num_free == pool.num_blocks == cache.num_blocks and not pool.tables
    # the rank's cache forgets the last finished sequences with the next step's batch, as it does every release
    assert set(cache.slots) == set(s.ranks[0].releases)
    core.worker.inputs(Batch(releases=s.ranks[0].releases))
    assert not cache.slots and not cache.lengths and len(cache.free_slots) == cache.max_seqs


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_engine_tokens_equal_transformers(pair, block_size):
    """dsrun's engine on the paged cache: a token budget that cuts prompts mid-window and mid-block (chunked
    prefill, decodes beside prefills), n = 3 greedy samples of one prompt (forked caches sharing its full blocks),
    and a cache too small for all (preemption, recompute): every sample's tokens equal transformers' generate."""
    model, cfg, reference, _ = pair
    lengths = (37, cfg.hca_compress_rate + 23, 2 * cfg.sliding_window + 9)
    prompts = [prompt(cfg.vocab_size, n, seed=100 + n) for n in lengths]
    new_tokens = 8
    with torch.no_grad():
        want = [reference.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    cache = V4Cache(cfg, 160, torch.float32, block_size=block_size, max_seqs=5)  # the longest alone fits
    core = new_engine(model, cache, Dist(), EngineConfig(
        vocab_size=cfg.vocab_size, max_model_len=4096,
        scheduler=SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=23)))
    s = core.scheduler
    for i, p in enumerate(prompts):
        s.add(str(i), p, SamplingParams(max_tokens=new_tokens, n=3 if i == 0 else 1), None)
    got: dict[tuple[str, int], list[int]] = {}
    while s.has_work:
        for _, out in core.step():
            got.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
    assert s.preemptions > 0
    assert got == {(str(i), j): want[i] for i in range(len(prompts)) for j in range(3 if i == 0 else 1)}


# The INT8 (C8) cache on this fixture's random weights, against auto, both float32: what docs/v4.md reports.
INT8_COSINE_MIN = 0.999
INT8_AGREEMENT_MIN = 14


def test_int8_cache_close_to_auto(pair):
    """--kv-cache-dtype int8: entries, windows and indexer keys stored INT8 (the indexer scoring A8C8), over a
    prompt that reaches every layer type's compressed entries: the logits of one prefill and of steps of any
    size against the auto cache's, and greedy agreement over 20 tokens."""
    model, cfg, _, _ = pair
    ids = prompt(cfg.vocab_size, PROMPT_LEN, seed=2)
    with torch.no_grad():
        logits = {}
        for kv in ("auto", "int8"):
            cache = V4Cache(cfg, PROMPT_LEN, torch.float32, kv_cache_dtype=kv)
            assert all(t.dtype == torch.int8 for t in cache.layers[2].window.tensors()[:1]) == (kv == "int8")
            logits[kv] = Steps(cache).forward(model, [(0, ids)])
        int8 = V4Cache(cfg, PROMPT_LEN + 64, torch.float32, kv_cache_dtype="int8")
        stepped = Steps(int8)
        chunks = [stepped.forward(model, [(0, ids[:37])]), stepped.forward(model, [(0, ids[37:])])]
        got = greedy(model, V4Cache(cfg, 512, torch.float32, kv_cache_dtype="int8"), [ids], NEW_TOKENS, eos_id=None)[0]
        want = greedy(model, V4Cache(cfg, 512, torch.float32), [ids], NEW_TOKENS, eos_id=None)[0]
    similarity = cosine(logits["int8"], logits["auto"])
    agree = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), NEW_TOKENS)
    print(f"deepseek_v4 INT8 vs auto cache logits cosine over {len(ids)} positions: {similarity:.5f}; greedy tokens "
          f"equal for the first {agree} of {NEW_TOKENS} ({sum(a == b for a, b in zip(got, want))} positionwise)")
    assert similarity >= INT8_COSINE_MIN
    # steps continue the INT8 cache: a chunk's own keys are rounded as stored (without that the two differ by 0.77
    # here); the bound leaves room for a key value that GEMM blocking of another chunk size tips to the next code
    torch.testing.assert_close(torch.cat(chunks), logits["int8"], rtol=0, atol=1e-2)
    assert agree >= INT8_AGREEMENT_MIN
