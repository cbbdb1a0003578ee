"""MTP speculative decoding (runner/engine/speculative.py, deepseek_v3.MultiTokenPredictor), on the tiny V3.2 in
float32 (index_topk 8: the MTP layer's indexer selects too):
- the MTP layer's drafts equal a reference built from transformers' own V3.2 decoder layer, loaded with the
  checkpoint's MTP block, and its norms and projection;
- verification and rollback with an oracle drafter (the tokens decoding without speculation gives, wrong at a chosen
  draft position): exact tokens and the acceptance counts that follow, through chunked prefill, decodes beside
  prefills, preemption, prefix-cache hits and the INT8 cache;
- the real MTP layer's drafts do not depend on how the steps are cut, and the tokens never change;
- at world 16 (DP16 / EP16 / lm_head TP16) the tokens equal world 1's without speculation."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from dsconv.errors import InputError
from dsconv.family.layout import Layout
from dsconv.runner.engine import sampler, worker as worker_module
from dsconv.runner.engine.config import RunConfig, EngineConfig, SchedulerConfig
from dsconv.runner.engine.grammar import Grammars, json_spec
from dsconv.runner.engine.core import new_engine
from dsconv.runner.engine.request import SamplingParams
from dsconv.runner.engine.speculative import SpeculativeConfig, accept_greedy
from dsconv.runner.engine.batch import SampleSpec
from dsconv.runner.models.dist import Dist
from dsconv.runner.models.registry import build_model
from dsconv.runner.models.v4_cache import speculative_windows
from dsconv.runner.models.weights import load_manifest
from tests.helpers import generate_ranks, shard
from tests.mtp_training import mtp_layer, v4_mtp_layer

NEW_TOKENS = 12


FAMILIES = ("deepseek_v32", "deepseek_v4")


@pytest.fixture(scope="module")
def mtp_models(tiny_source, tmp_path_factory):
    """mtp_models(family) -> (world-1 shards of the tiny checkpoint, the model with its MTP layer, its cache
    factory with room for k = 3), built once per module."""
    built = {}

    def get(family: str):
        if family not in built:
            shards = tmp_path_factory.mktemp(f"speculative-{family}") / "w1"
            shard(tiny_source(family, "fp8"), shards, Layout(1, 1, 1, 1))
            model, _, new_cache = build_model(shards, load_manifest(shards), 0, Dist(), torch.float32,
                                              speculative_tokens=3)
            built[family] = shards, model, new_cache
        return built[family]
    return get


@pytest.fixture(scope="module")
def v32(mtp_models):
    return mtp_models("deepseek_v32")


@pytest.fixture(scope="module", params=FAMILIES)
def each_family(request, mtp_models):
    return mtp_models(request.param)


def prompts_of(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 500, (n,), generator=gen).tolist() for n in lengths]


def run(model, new_cache, prompts, k, budget=4096, cache_tokens=1024, kv_cache_dtype="auto", repeat=1,
        max_num_seqs=4, new_tokens=NEW_TOKENS, grammars=None, grammar=None):
    """The prompts (each `repeat` times, one round after another) through one engine, greedy (held to `grammar`,
    with `grammars`, if given) -> (tokens per prompt and round, the drafts proposed {(request id, position they
    start at): drafts}, the scheduler)."""
    cache = new_cache(cache_tokens, kv_cache_dtype, block_size=16, max_seqs=max_num_seqs)
    config = EngineConfig(vocab_size=model.cfg.vocab_size, max_model_len=4096,
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
                          speculative=SpeculativeConfig("mtp", k) if k else None)
    core = new_engine(model, cache, Dist(), config, grammars=grammars)
    s, tokens, drafts = core.scheduler, {}, {}
    for round_ in range(repeat):
        for i, prompt in enumerate(prompts):
            s.add(f"{round_}-{i}", prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, grammar=grammar),
                  None)
        while s.has_work:
            for request, out in core.step():
                tokens.setdefault(request.request_id, []).extend(out.new_token_ids)
            for request in s.ranks[0].running:
                if request.drafts:
                    drafts[request.request_id, len(request.tokens)] = tuple(request.drafts)
    return [tokens[f"{r}-{i}"] for r in range(repeat) for i in range(len(prompts))], drafts, s


def test_config_refusals():
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 3}') == SpeculativeConfig("mtp", 3)
    for text, message in [("{", "is not JSON"), ("[1]", "must be a JSON object"),
                          ('{"method": "eagle", "num_speculative_tokens": 1}', "method 'eagle' is not one of mtp"),
                          ('{"method": "mtp", "num_speculative_tokens": 4}', "4 must be an integer from 1 to 3"),
                          ('{"method": "mtp", "num_speculative_tokens": 0}', "0 must be an integer from 1 to 3"),
                          ('{"method": "mtp", "num_speculative_tokens": true}', "True must be an integer"),
                          ('{"method": "mtp", "num_speculative_tokens": 1, "model": "x"}', "keys dsrun does not take")]:
        with pytest.raises(InputError, match=message):
            SpeculativeConfig.parse(text)
    assert accept_greedy([5, 6, 7], (5, 6)) == [5, 6, 7]  # both accepted, then the bonus token
    assert accept_greedy([5, 9, 7], (5, 6)) == [5, 9]  # the second rejected: the target's token instead
    assert accept_greedy([4, 6, 7], (5, 6)) == [4]


def mtp_reference(source, ids: list[int], scratch) -> list[int]:
    """transformers' model on the bf16 source, then its MTP layer as the hub's weights describe it, the block being
    transformers' own decoder layer (tests/mtp_training.py) -> at each position t < len(ids) - 1 the argmax the layer
    predicts for position t + 2."""
    main = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    weights = {}
    for path in sorted(source.glob("*.safetensors")):
        weights.update(load_file(path))
    config = json.loads((source / "config.json").read_text())
    if config["model_type"] == "deepseek_v4":
        mtp = v4_mtp_layer(config, weights, scratch)
    else:
        mtp = mtp_layer(main, config, weights, config["num_hidden_layers"], scratch)
    with torch.no_grad():
        return mtp.logits(main, torch.tensor([ids]))[0].argmax(dim=-1).tolist()


def test_mtp_drafts_equal_a_transformers_reference(each_family, tiny_source, tmp_path):
    """k = 1: each draft is the reference MTP layer's prediction at its position (DeepSeek-V4: from the final
    hyper-connection streams, through the layer's own hc_head)."""
    shards, model, new_cache = each_family
    family = load_manifest(shards)["model"]["config"]["model_type"]
    prompts = prompts_of((37, 9))
    tokens, drafts, _ = run(model, new_cache, prompts, k=1)
    assert drafts
    for i, prompt in enumerate(prompts):
        predicted = mtp_reference(tiny_source(family, "bf16"), prompt + tokens[i], tmp_path / f"mtp-{i}")
        mine = {position: d for (request, position), d in drafts.items() if request == f"0-{i}"}
        assert len(mine) >= NEW_TOKENS - 1
        assert {position: d[0] for position, d in mine.items()} == {p: predicted[p - 2] for p in mine}


def oracle_drafter(core_of, full, wrong_at):
    """A Worker._draft that proposes what decoding without speculation gives next (`full`: request id -> prompt +
    its tokens), each draft at position `wrong_at` replaced by another token; the verified tokens recomputed from
    the logits as the worker does."""
    def draft(worker, batch, inputs, logits, plan):
        scheduler, out, at = core_of(), [], 0
        for i, seq_id in enumerate(batch.seq_ids):
            spec, scores = batch.samples[i], batch.scores[i]
            at += len(scores.targets) if scores is not None else 0
            if spec is None:
                out.append([])
                continue
            k_i = len(spec.drafts)
            emitted = accept_greedy(logits[at:at + k_i + 1].argmax(dim=-1).tolist(), spec.drafts)
            at += k_i + 1
            _, _, context = batch.span(i)
            known = context - k_i + len(emitted)
            right = full[scheduler.by_seq[seq_id].request_id][known:known + spec.propose]
            out.append([(t + 1) % 500 if j == wrong_at else t for j, t in enumerate(right)])
        return out
    return draft


@pytest.fixture
def oracle(monkeypatch):
    """oracle(full, wrong_at): the engines `run` builds from now on draft with `oracle_drafter`."""
    holder = {}
    original = new_engine

    def engine_kept(*args, **kwargs):
        holder["core"] = original(*args, **kwargs)
        return holder["core"]

    monkeypatch.setattr(f"{__name__}.new_engine", engine_kept)

    def install(full, wrong_at):
        monkeypatch.setattr(worker_module.Worker, "_draft",
                            oracle_drafter(lambda: holder["core"].scheduler, full, wrong_at))
    return install


@pytest.mark.parametrize("budget,cache_tokens,kv_cache_dtype", [(4096, 1024, "auto"), (7, 1024, "int8"),
                                                                 (9, 96, "auto")])
def test_oracle_drafts_verify_and_roll_back(each_family, oracle, budget, cache_tokens, kv_cache_dtype):
    """Budget 7: every prompt in chunks, decodes beside them; a 96-token cache: preemption; each prompt twice, the
    second round from the prefix cache. With drafts right up to position `wrong_at` (k = 3), each verification
    accepts exactly those before it: the per-position counts show it, the tokens never change. DeepSeek-V4's
    rejected rows cross its windows, compressor windows (4: CSA) and blocks."""
    _, model, new_cache = each_family
    # with room, one prompt decodes across position 127, where V4's HCA (ratio 128) pools its first window
    prompts = prompts_of((37, 5, 21) + ((121,) if cache_tokens > 256 else ()), seed=1)
    base, _, _ = run(model, new_cache, prompts, 0, budget, cache_tokens, kv_cache_dtype, repeat=2)
    full = {f"{r}-{i}": prompts[i] + base[r * len(prompts) + i] for r in range(2) for i in range(len(prompts))}
    for wrong_at in (None, 0, 1, 2):
        oracle(full, wrong_at)
        got, _, s = run(model, new_cache, prompts, 3, budget, cache_tokens, kv_cache_dtype, repeat=2)
        assert got == base, wrong_at
        spec = s.spec  # near max_tokens, and where the budget cuts them, fewer than 3 drafts are verified
        assert spec.drafts and not any(spec.accepted_per_pos[3 if wrong_at is None else wrong_at:]), (wrong_at, spec)
        if wrong_at is None:
            assert spec.accepted_tokens == spec.draft_tokens, spec
        if wrong_at != 0:  # the first draft of every verification is right
            assert spec.accepted_per_pos[0] == spec.drafts, spec
        if budget == 4096:
            assert s.prefix_hits > 0
        if cache_tokens == 96:
            assert s.preemptions > 0


def test_mtp_drafts_do_not_depend_on_the_steps(each_family):
    """The real MTP layer, k = 3 (chained on its own states): the drafts proposed at each position of each request
    are the same whether the prompts run whole or in chunks of 7 tokens beside each other's decodes, and the
    tokens equal those without speculation."""
    _, model, new_cache = each_family
    prompts = prompts_of((37, 5, 21), seed=2)
    base, _, _ = run(model, new_cache, prompts, 0)
    whole, drafts_whole, s = run(model, new_cache, prompts, 3)
    chunked, drafts_chunked, _ = run(model, new_cache, prompts, 3, budget=7)
    assert whole == chunked == base
    assert drafts_whole == drafts_chunked and s.spec.drafts >= len(prompts) * 3


def test_a_cache_that_just_holds_the_request(each_family, oracle):
    """A 20-token prompt and 12 new tokens in a cache of exactly 32 tokens, k = 3, with the MTP layer's drafts and
    with drafts that are all right: near the end the drafts and the MTP layer's chained passes stop where the
    request's table does; the request finishes with its tokens, no preemption."""
    _, model, new_cache = each_family
    prompts = prompts_of((20,), seed=4)
    base, _, _ = run(model, new_cache, prompts, 0, cache_tokens=32, max_num_seqs=1)
    real, _, s = run(model, new_cache, prompts, 3, cache_tokens=32, max_num_seqs=1)  # the MTP layer's own drafts
    assert real == base and s.preemptions == 0
    full = {"0-0": prompts[0] + base[0]}
    oracle(full, None)
    got, _, s = run(model, new_cache, prompts, 3, cache_tokens=32, max_num_seqs=1)
    assert got == base and s.preemptions == 0 and s.spec.accepted_tokens > 0


def test_forked_samples_draft_and_keep_their_tokens(each_family, oracle):
    """n = 3 greedy samples of each prompt, k = 3: once forked, each sample drafts on its own copy of the parent's
    partial block and sequence slot (DeepSeek-V4: windows and compressor state) and rewinds alone; with the MTP
    layer's drafts and with drafts right up to the second, every sample's tokens equal decoding without
    speculation."""
    _, model, new_cache = each_family
    prompts = prompts_of((37, 21), seed=7)
    base, _, _ = run(model, new_cache, prompts, 0)
    for drafter in ("mtp", "oracle"):
        if drafter == "oracle":
            oracle({f"0-{i}": prompts[i] + base[i] for i in range(len(prompts))}, 1)
        cache = new_cache(1024, "auto", block_size=16, max_seqs=6)
        core = new_engine(model, cache, Dist(), EngineConfig(
            vocab_size=model.cfg.vocab_size, max_model_len=4096, scheduler=SchedulerConfig(max_num_seqs=6),
            speculative=SpeculativeConfig("mtp", 3)))
        for i, prompt in enumerate(prompts):
            core.scheduler.add(f"0-{i}", prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, n=3), None)
        got: dict[tuple[str, int], list[int]] = {}
        while core.scheduler.has_work:
            for _, out in core.step():
                got.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        assert got == {(f"0-{i}", j): base[i] for i in range(len(prompts)) for j in range(3)}, drafter
        assert core.scheduler.spec.drafts > 0
        if drafter == "oracle":
            assert core.scheduler.spec.accepted_per_pos[0] == core.scheduler.spec.drafts


@pytest.fixture(scope="module")
def tiny_grammars(tmp_path_factory):
    """Grammars over a BPE tokenizer of the tiny models' vocabulary (1,024 ids, end-of-sentence 1), trained on a few
    standard-library modules, as the trained models' is."""
    from tests.trained import stdlib_text, train_tokenizer

    path = tmp_path_factory.mktemp("grammar-tokenizer") / "tokenizer.json"
    train_tokenizer(stdlib_text(("json/__init__.py", "json/decoder.py", "json/encoder.py", "csv.py"))).save(str(path))
    return Grammars(path, 1024, 1)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
          "required": ["name", "count"]}


def test_grammar_constrains_drafts_and_verification(each_family, oracle, tiny_grammars):
    """Greedy requests held to a JSON schema, k = 3: the MTP layer drafts only what the grammar allows after the
    request's output (every proposed draft sequence is one the grammar accepts), verification masks each row as
    the grammar stands after the drafts before it, and the tokens equal decoding without speculation, with the MTP
    layer's drafts and with drafts right up to the second (the wrong one is usually outside the grammar)."""
    _, model, new_cache = each_family
    prompts = prompts_of((37, 21), seed=8)
    spec = json_spec(SCHEMA, False)
    base, _, _ = run(model, new_cache, prompts, 0, grammars=tiny_grammars, grammar=spec)
    got, drafts, s = run(model, new_cache, prompts, 3, grammars=tiny_grammars, grammar=spec)
    assert got == base and s.spec.drafts > 0
    full = {f"0-{i}": prompts[i] + base[i] for i in range(len(prompts))}
    xgr = tiny_grammars._xgr()
    for (request, position), proposed in drafts.items():
        matcher = xgr.GrammarMatcher(tiny_grammars.compile(spec))
        prompt_len = len(prompts[int(request.split("-")[1])])
        assert all(matcher.accept_token(t) for t in full[request][prompt_len:position] + list(proposed)), proposed
    oracle(full, 1)
    got, _, s = run(model, new_cache, prompts, 3, grammars=tiny_grammars, grammar=spec)
    assert got == base and s.spec.accepted_per_pos[0] == s.spec.drafts and not s.spec.accepted_per_pos[1]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_world_16_tokens_equal_world_1_without_speculation(mtp_models, family, tiny_source, tmp_path):
    """DP16 / EP16 / lm_head TP16, k = 1 and 3: each rank drafts for its own requests through the MTP layer's EP
    exchange and lm_head gather (chained passes too); the tokens equal world 1's without speculation, and drafts
    were verified."""
    _, model, new_cache = mtp_models(family)
    prompts = prompts_of((37, 5, 21, 9), seed=3)
    base, _, _ = run(model, new_cache, prompts, 0)
    shards = tmp_path / "w16"
    shard(tiny_source(family, "fp8"), shards, Layout(16, 16, 16, 1))
    for k in (1, 3):
        got = generate_ranks(shards, tmp_path / f"results-{k}", prompts, "float32", NEW_TOKENS,
                             speculative=SpeculativeConfig("mtp", k))
        assert got["generated"] == base, k
        assert got["speculative"]["num_drafts"] > 0 and got["speculative"]["num_speculative_tokens"] == k


def test_speculation_needs_mtp_shards_and_no_cp(v32, tiny_source, tmp_path):
    """Each refusal is one line: shards without an MTP layer, context parallelism, a DeepSeek-V4 compress ratio
    smaller than the drafts (rejected rows could complete two of its windows); V4 shards with MTP are taken."""
    shards, _, _ = v32
    config = SpeculativeConfig("mtp", 1)
    run = RunConfig.open(shards, speculative=config)
    assert run.speculative == config and "MTP, 1 draft token a step (greedy" in run.speculative.summary
    no_mtp = dict(run.manifest, tensors=[dict(t, mtp=False) for t in run.manifest["tensors"] if not t["mtp"]])
    with pytest.raises(InputError, match="holds no MTP layer"):
        dataclasses.replace(run, manifest=no_mtp)._check_speculative()
    with pytest.raises(InputError, match="does not combine with --prefill-context-parallel-size"):
        dataclasses.replace(run, scheduler=SchedulerConfig(cp_size=2, cp_min_tokens=1))._check_speculative()
    v4 = tmp_path / "v4"
    shard(tiny_source("deepseek_v4", "fp8"), v4, Layout(1, 1, 1, 1))
    assert RunConfig.open(v4, speculative=SpeculativeConfig("mtp", 3)).speculative_tokens == 3
    assert speculative_windows(4, 3) == 2 and speculative_windows(128, 0) == 1
    with pytest.raises(InputError, match="num_speculative_tokens 3 exceeds deepseek_v4's compress ratio 2"):
        speculative_windows(2, 3)


def expected_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """NumPy's reading of the documented sampling rule: softmax at the temperature, the top_k most likely tokens, of
    them the smallest prefix whose mass reaches top_p, renormalized."""
    z = logits.double().numpy() / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = order[:min(top_k, max(1, int((before < top_p).sum())))]
    out = np.zeros_like(p)
    out[keep] = p[keep] / p[keep].sum()
    return out


DRAWS = 6000
TOP_TOKENS = 8


def test_speculative_sampling_keeps_the_target_distribution(v32, monkeypatch):
    """The tiny V3.2's next-token logits after a prompt, at temperature 0.5, top_k 50, top_p 0.95: over 6,000 seeds
    the first token speculative sampling emits, the draft being the second most likely token, follows the target
    distribution (NumPy's reading of the rule): a chi-square test over the 8 most likely tokens and the rest passes.
    It fails for a biased rule that on a rejection draws from the whole distribution, the draft included."""
    _, model, new_cache = v32
    cache = new_cache(256, "auto", block_size=16, max_seqs=1)
    from dsconv.runner.engine.worker import InputBuilder
    from dsconv.runner.engine.batch import Batch

    batch = Batch()
    batch.add(0, prompts_of((20,), seed=5)[0], 20, list(range(2)), 16, None, None)
    inputs = InputBuilder(cache)(batch)
    with torch.no_grad():
        logits = model.forward(inputs.tokens, inputs.meta, cache)[-1]
    temperature, top_k, top_p = 0.5, 50, 0.95
    p = expected_distribution(logits, temperature, top_k, top_p)
    top = np.argsort(-p, kind="stable")[:TOP_TOKENS]
    draft = int(top[1])

    def pvalue() -> float:
        counts = np.zeros(TOP_TOKENS + 1)
        for seed in range(DRAWS):
            spec = SampleSpec(temperature, top_p, top_k, seed, 0, None, drafts=(draft,), propose=1)
            token = sampler.verify(torch.stack([logits, logits]), spec)[0]
            hit = np.nonzero(top == token)[0]
            counts[hit[0] if len(hit) else TOP_TOKENS] += 1
        expected = DRAWS * np.append(p[top], 1 - p[top].sum())
        return chisquare(counts, expected).pvalue

    fair = pvalue()
    monkeypatch.setattr(sampler, "without", lambda probs, token: probs)
    biased = pvalue()
    print(f"p(draft) {p[draft]:.3f}; chi-square p-values: the rule {fair:.3g}, the biased rule {biased:.3g}")
    assert fair > 1e-3 and biased < 1e-9


def test_sampled_requests_draft_and_repeat(v32):
    """Seeded requests at temperature 1 with k = 2: drafts are verified by speculative sampling, every request
    gets its tokens, and the same seeds give the same tokens again."""
    _, model, new_cache = v32
    prompts = prompts_of((17, 30), seed=6)

    def sampled():
        cache = new_cache(1024, "auto", block_size=16, max_seqs=4)
        core = new_engine(model, cache, Dist(), EngineConfig(
            vocab_size=model.cfg.vocab_size, max_model_len=4096, scheduler=SchedulerConfig(max_num_seqs=4),
            speculative=SpeculativeConfig("mtp", 2)))
        out = {}
        for i, prompt in enumerate(prompts):
            core.scheduler.add(str(i), prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=7 + i),
                               None)
        while core.scheduler.has_work:
            for request, o in core.step():
                out.setdefault(request.request_id, []).extend(o.new_token_ids)
        return [out[str(i)] for i in range(len(prompts))], core.scheduler.spec

    first, spec = sampled()
    assert [len(t) for t in first] == [NEW_TOKENS] * 2 and spec.drafts > 0
    assert sampled()[0] == first


# The trained models' MTP layers (tests/mtp_training.py), k = 1, greedy, float32, on held-out text, measured on the
# models trained with IEEE's square root, the same bytes on every CPU: V3.2 1.68 (k = 3: 2.19, per position 0.65 /
# 0.32 / 0.22), V4 1.67 (k = 3: 2.25, 0.67 / 0.37 / 0.20); the line is 1.6. A layer that drafts at random or
# reads the wrong hidden states accepts almost nothing (1.00 on the random fixtures).
TRAINED_ACCEPTANCE_MIN = 1.6
TRAINED_NEW_TOKENS = 48


@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v4"])
def test_trained_mtp_layer_drafts_what_the_model_then_says(family, trained_shards):
    """A trained model (BF16 shards of its hub-format checkpoint, float32 compute): held-out text, 48 tokens each,
    with k = 1 and 3: the tokens of decoding without speculation, and a mean acceptance length at k = 1 of at least
    TRAINED_ACCEPTANCE_MIN."""
    from tokenizers import Tokenizer

    from tests.trained import heldout_texts, trained_source

    shards, _ = trained_shards(family)
    model, _, new_cache = build_model(shards, load_manifest(shards), 0, Dist(), torch.float32, speculative_tokens=3)
    tokenizer = Tokenizer.from_file(str(trained_source(family) / "tokenizer.json"))
    text = "\n".join(heldout_texts())
    prompts = [tokenizer.encode(text[i * 5000:i * 5000 + 600]).ids for i in range(4)]
    base, _, _ = run(model, new_cache, prompts, 0, cache_tokens=4096, new_tokens=TRAINED_NEW_TOKENS)
    for k in (1, 3):
        got, _, s = run(model, new_cache, prompts, k, cache_tokens=4096, new_tokens=TRAINED_NEW_TOKENS)
        assert got == base, k
        print(f"k={k}: mean acceptance length {s.spec.mean_acceptance_length:.2f}, per position "
              f"{[round(c / s.spec.drafts, 2) for c in s.spec.accepted_per_pos]}")
        if k == 1:
            assert s.spec.mean_acceptance_length >= TRAINED_ACCEPTANCE_MIN


def test_server_streams_accepted_drafts_with_the_target_logprobs(trained_shards, tmp_path):
    """`dsrun serve --speculative-config` (k = 2) on the trained V3.2 through the openai client: a greedy streamed
    completion gives the tokens and logprobs of the same completion without speculation in process (the target's),
    some chunks carry several tokens (accepted drafts), and /metrics counts the drafts and acceptances."""
    import httpx
    from tokenizers import Tokenizer

    from tests.helpers import Server
    from tests.trained import heldout_texts, trained_source

    shards, _ = trained_shards("deepseek_v32")
    text = "\n".join(heldout_texts())[:400]
    prompt = Tokenizer.from_file(str(trained_source("deepseek_v32") / "tokenizer.json")).encode(text).ids
    model, _, new_cache = build_model(shards, load_manifest(shards), 0, Dist(), torch.float32)
    core = new_engine(model, new_cache(1024, block_size=16, max_seqs=1), Dist(), EngineConfig(
        vocab_size=model.cfg.vocab_size, max_model_len=4096, scheduler=SchedulerConfig(max_num_seqs=1)))
    core.scheduler.add("x", prompt, SamplingParams(max_tokens=32, temperature=0.0, logprobs=1), None)
    want, want_logprobs = [], []
    while core.scheduler.has_work:
        for _, out in core.step():
            want += out.new_token_ids
            want_logprobs += [lp.logprob for lp in out.new_logprobs]
    server = Server(shards, tmp_path / "serve.log", "--dtype", "float32", "--speculative-config",
                    '{"method": "mtp", "num_speculative_tokens": 2}')
    try:
        chunks = list(server.openai().completions.create(
            model=server.openai().models.list().data[0].id, prompt=prompt, max_tokens=32, temperature=0, stream=True,
            logprobs=1, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}))
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    finally:
        assert server.stop() == 0, server.log()
    parts = [[int(t.split(":")[1]) for t in c.choices[0].logprobs.tokens] for c in chunks if c.choices]
    assert [t for part in parts for t in part] == want and max(map(len, parts)) >= 2
    logprobs = [lp for c in chunks if c.choices for lp in c.choices[0].logprobs.token_logprobs]
    assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
    for name in ("num_drafts", "num_accepted_tokens"):
        line = next(line for line in metrics.splitlines() if line.startswith(f"dsrun:spec_decode_{name}_total"))
        assert float(line.split()[-1]) > 0, line
    assert 'dsrun:spec_decode_num_accepted_tokens_per_pos_total{model_name=' in metrics
