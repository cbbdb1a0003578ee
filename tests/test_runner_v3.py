"""The V3 / V3.2 runner against transformers' DeepseekV3/V32ForCausalLM on the same weights (world size 1)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from dsconv.family.deepseek_v3 import parse_config
from dsconv.errors import InputError
from dsconv.runner.models import step as step_module
from dsconv.runner.models.kv_cache import LatentCache
from dsconv.runner.models.dist import Dist
from tests.helpers import greedy
from dsconv.runner.models.layers import Proj
from dsconv.family.deepseek_v3 import cache_fields
from dsconv.runner.models.deepseek_v3 import Attention, DeepseekV3
from dsconv.runner.models.weights import load_manifest, load_rank
from dsconv.family.layout import Layout
from tests.helpers import Recorder, Steps, cosine, last_rows, shard

COSINE_MIN = 0.999
PROMPT_LEN = 40
NEW_TOKENS = 20
BLOCK_SIZE = 16  # smaller than the prompt: prefill spans several cache blocks
CACHE_TOKENS = 1024


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v32"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def pair(family, tiny_source, tmp_path_factory):
    """(our model factory, transformers model) on identical float32 weights."""
    shards = tmp_path_factory.mktemp(f"{family}-bf16-shards") / "s"
    shard(tiny_source(family, "fp8"), shards, Layout(1, 1, 1, 1))
    reference = AutoModelForCausalLM.from_pretrained(tiny_source(family, "bf16"), dtype=torch.float32).eval()

    def ours(block_size=BLOCK_SIZE):
        manifest = load_manifest(shards)
        cfg = parse_config(manifest["model"]["config"])
        model = DeepseekV3(cfg, load_rank(shards, manifest, 0), Dist(), torch.float32)
        cache = LatentCache(cfg.num_hidden_layers, CACHE_TOKENS // block_size, block_size, cache_fields(cfg),
                            torch.float32)
        return model, cache, cfg

    ours.shards = shards
    return ours, reference


def prompt(vocab, n=PROMPT_LEN, seed=0):
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def record_layer_outputs(model) -> list:
    """-> the list each layer's output [T, hidden] is appended to as the model runs: what the next layer's input
    norm gets, and the final norm after the last layer."""
    hidden = []
    for layer in range(1, len(model.layers)):
        model.layers[layer].attn_norm = Recorder(model.layers[layer].attn_norm, hidden, inputs=True)
    model.norm = Recorder(model.norm, hidden, inputs=True)
    return hidden


def test_prefill_hidden_states_and_logits(pair):
    ours, reference = pair
    model, cache, cfg = ours()
    ids = prompt(cfg.vocab_size)
    with torch.no_grad():
        ref = reference(torch.tensor([ids]), output_hidden_states=True)
        hidden = record_layer_outputs(model)
        logits = Steps(cache).forward(model, [(0, ids)])
    # transformers: embeddings, then each layer's output; its last entry is after the final norm
    for layer, (mine, theirs) in enumerate(zip(hidden[:-1], ref.hidden_states[1:-1])):
        assert cosine(mine, theirs[0]) >= COSINE_MIN, layer
    assert cosine(logits, ref.logits[0]) >= COSINE_MIN


@pytest.mark.parametrize("absorbed,prefill_scores", [(None, None), (True, None), (False, None), (False, 1)],
                         ids=["as-picked", "absorbed", "expanded", "expanded-a-query-at-a-time"])
def test_greedy_tokens_equal_transformers_generate(pair, absorbed, prefill_scores, monkeypatch):
    """absorbed: V3.2's prefill past index_topk in the absorbed form (True) or expanded (False) whatever the
    multiply-add count picks (None: as it picks, absorbed for the tiny shapes). prefill_scores 1: the attention and
    index scores taken one query at a time (step.PREFILL_SCORES bounds them; a long prompt takes a few hundred
    queries at a time)."""
    ours, reference = pair
    if absorbed is not None:
        monkeypatch.setattr(Attention, "absorbed_is_cheaper", lambda self, queries, context: absorbed)
    if prefill_scores is not None:
        monkeypatch.setattr(step_module, "PREFILL_SCORES", prefill_scores)
    model, cache, cfg = ours()
    ids = prompt(cfg.vocab_size, seed=1)
    with torch.no_grad():
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        got = greedy(model, cache, [ids], NEW_TOKENS, eos_id=None)[0]
    assert got == expected


def test_greedy_tokens_equal_transformers_in_blocks_of_64(pair):
    """A prompt inside the first block of 64 tokens, its decode crossing into the second."""
    ours, reference = pair
    model, cache, cfg = ours(block_size=64)
    ids = prompt(cfg.vocab_size, n=56, seed=3)
    with torch.no_grad():
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        got = greedy(model, cache, [ids], NEW_TOKENS, eos_id=None)[0]
    assert got == expected


def test_context_shorter_than_index_topk_equals_transformers_generate(pair):
    # V3.2 skips the indexer while the context is no longer than index_topk (it would keep every position);
    # 4 prompt tokens and 8 new ones cross the fixture's index_topk of 8 mid-generation
    ours, reference = pair
    model, cache, cfg = ours()
    ids = prompt(cfg.vocab_size, n=4, seed=5)
    if cfg.has_indexer:
        assert len(ids) < cfg.index_topk < len(ids) + 8
    with torch.no_grad():
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(ids):].tolist()
        assert greedy(model, cache, [ids], 8, eos_id=None)[0] == expected


def test_batch_of_different_lengths_equals_each_alone(pair):
    ours, _ = pair
    model, _, cfg = ours()
    prompts = [prompt(cfg.vocab_size, n, seed=n) for n in (5, 23, 40)]
    new_tokens = 12  # the first prompt grows into a new block after the others': its blocks are not consecutive
    alone = []
    for p in prompts:
        model, cache, _ = ours()
        alone.append(greedy(model, cache, [p], new_tokens, eos_id=None)[0])
    model, cache, _ = ours()
    assert greedy(model, cache, prompts, new_tokens, eos_id=None) == alone


@pytest.mark.parametrize("gather_rows", [step_module.DECODE_GATHER_ROWS, 40], ids=["one-group", "two-groups"])
def test_decodes_beside_prefills_equal_each_alone(pair, gather_rows, monkeypatch):
    # a step whose one-token sequences (attended together, padded to the longest context) are not its first rows:
    # a prefill chunk comes first and another between them; contexts below and above V3.2's index_topk of 8.
    # 40 gather rows: the two decodes (contexts 4 and 31) attend in two groups
    monkeypatch.setattr(step_module, "DECODE_GATHER_ROWS", gather_rows)
    ours, _ = pair
    model, _, cfg = ours()
    short, long_, fresh, other = (prompt(cfg.vocab_size, n, seed=n) for n in (3, 30, 17, 11))

    def last_logits(model, cache, steps):
        """Runs steps of (seq_id, tokens); -> each step's last-row logits per sequence."""
        out, runner = [], Steps(cache)
        for step in steps:
            inputs = runner.inputs(step)
            with torch.no_grad():
                logits = model.forward(inputs.tokens, inputs.meta, cache, rows=last_rows(inputs.meta))
            out.append({seq_id: logits[i] for i, (seq_id, _) in enumerate(step)})
        return out

    steps = [[(0, short), (1, long_)], [(2, fresh), (0, [7]), (3, other), (1, [9])]]
    together = last_logits(model, ours()[1], steps)[1]
    for seq_id in (0, 1):  # each decode alone: its prompt, then its one token
        alone = last_logits(model, ours()[1], [[(seq_id, dict(s)[seq_id])] for s in steps])[1][seq_id]
        torch.testing.assert_close(together[seq_id], alone, rtol=1e-5, atol=1e-5)
    for seq_id, tokens in ((2, fresh), (3, other)):
        alone = last_logits(model, ours()[1], [[(seq_id, tokens)]])[0][seq_id]
        torch.testing.assert_close(together[seq_id], alone, rtol=1e-5, atol=1e-5)


# What docs/run.md reports for this fixture (random weights, fixed seed): logits cosine 0.99795 (V3) and 0.99781
# (V3.2); greedy tokens equal to BF16's for the first 4 (V3) and 20 (V3.2) of 20. Random weights leave near-ties
# between top tokens, so agreement is asserted with a margin below what was measured.
W8A8_COSINE_MIN = 0.997
W8A8_AGREEMENT_MIN = {"deepseek_v3": 3, "deepseek_v32": 16}


def test_w8a8_logits_close_to_bf16(family, pair, w8a8_source, tmp_path):
    # V3.2 measured 0.82-0.88 while the fixture's power-of-two scales were rounded to nearest (q_b projections
    # 1.66x, attention and indexer logits ~2.5x too large) and residual branches were unscaled: INT8 error then
    # flipped the indexer's discrete top-8-of-40 choice, and this random indexer's top-8 holds only ~0.4 of the
    # attention mass (DeepSeek distils its indexer toward the attention), so each flip moved real mass. With
    # unbiased scales and scaled residual init a scratch sweep (not in this suite) measured >= 0.994 over 6
    # checkpoint seeds x 2 prompts; this test checks the suite's one fixture.
    ours, _ = pair
    bf16_model, bf16_cache, cfg = ours()
    shards = tmp_path / "w8a8-shards"
    shard(w8a8_source(family), shards, Layout(1, 1, 1, 1))
    manifest = load_manifest(shards)
    assert manifest["precision"] == "w8a8"
    model = DeepseekV3(cfg, load_rank(shards, manifest, 0), Dist(), torch.float32)
    cache = LatentCache(cfg.num_hidden_layers, 64, BLOCK_SIZE, cache_fields(cfg), torch.float32)
    ids = prompt(cfg.vocab_size, seed=2)
    with torch.no_grad():
        logits = Steps(cache).forward(model, [(0, ids)])
        reference = Steps(bf16_cache).forward(bf16_model, [(0, ids)])
    similarity = cosine(logits, reference)
    print(f"{family} W8A8 vs BF16 logits cosine over {len(ids)} positions: {similarity:.5f}")
    assert similarity >= W8A8_COSINE_MIN

    bf16_model, bf16_cache, _ = ours()
    with torch.no_grad():
        cache = LatentCache(cfg.num_hidden_layers, 64, BLOCK_SIZE, cache_fields(cfg), torch.float32)
        got = greedy(model, cache, [ids], NEW_TOKENS, eos_id=None)[0]
        want = greedy(bf16_model, bf16_cache, [ids], NEW_TOKENS, eos_id=None)[0]
    agree = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), NEW_TOKENS)
    print(f"{family} W8A8 greedy tokens equal to BF16 for the first {agree} of {NEW_TOKENS}")
    assert agree >= W8A8_AGREEMENT_MIN[family]


# V3 measured 0.99997. V3.2 measured 0.964: BF16 rounding reorders some of the indexer's top-8-of-40 choices on
# this random fixture, whose 4 index heads leave many exact ties at 0 (see the W8A8 test below); it was 0.985
# when torch.topk broke those ties, 0.964 since they are broken by position (for chunk-independent choices)
BF16_DECODE_COSINE_MIN = {"deepseek_v3": 0.999, "deepseek_v32": 0.95}


def test_bf16_decode_steps_close_to_float32(family, pair):
    """The BF16 decode path (absorbed MLA in float32 products on CPU, the one-token MoE path) against the same
    model in float32, step by step on the same tokens."""
    ours, _ = pair
    model32, cache32, cfg = ours()
    manifest = load_manifest(ours.shards)
    model16 = DeepseekV3(cfg, load_rank(ours.shards, manifest, 0), Dist(), torch.bfloat16)
    cache16 = LatentCache(cfg.num_hidden_layers, 64, BLOCK_SIZE, cache_fields(cfg), torch.bfloat16)
    ids = prompt(cfg.vocab_size, seed=3)
    tokens = torch.tensor(ids)
    worst, steps32, steps16 = 1.0, Steps(cache32), Steps(cache16)
    with torch.inference_mode():
        for step in range(6):  # the prompt, then one token per step fed back from the float32 model
            logits32 = steps32.forward(model32, [(0, tokens.tolist())])[-1]
            logits16 = steps16.forward(model16, [(0, tokens.tolist())])[-1]
            if step:
                worst = min(worst, cosine(logits16.float(), logits32))
            tokens = logits32.argmax()[None]
    print(f"BF16 vs float32 decode logits cosine, worst of 5 steps: {worst:.5f}")
    assert worst >= BF16_DECODE_COSINE_MIN[family]


def test_merged_projection_refuses_mixed_types(pair):
    ours, _ = pair
    weights = load_rank(ours.shards, load_manifest(ours.shards), 0)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa"
    weights.tensors[f"{name}.weight_scale"] = torch.ones(weights.tensors[f"{name}.weight"].shape[0], 1)
    with pytest.raises(InputError, match="mix INT8 and float"):
        Proj.merged(weights, ["model.layers.0.self_attn.q_a_proj", name], torch.float32)
