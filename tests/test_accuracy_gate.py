"""The W8A8 accuracy gate on trained tiny checkpoints (convert/trained.py): W8A8 shards (dsconv quantize, the
default recipe, then shard) against BF16 shards of the same checkpoint, on held-out standard-library source, in
float32 compute on both sides, so the figures measure the INT8 weights and activations alone. And dsrun
perplexity on the trained model equals transformers' (float32) of the same windows, on one rank and on 16."""

import math

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from dsconv.convert.trained import FAMILIES, HELDOUT_MODULES, encode_fp4, encode_fp8, heldout_texts, snap
from dsconv.family.arch import Encoding
from dsconv.convert.tiny_checkpoint import decode_fp4, decode_fp8
from dsconv.runner.engine.worker import start_rank
from dsconv.runner.engine.offline import greedy
from dsconv.runner.entrypoints.perplexity import summarize, windows
from dsconv.runner.models.weights import load_manifest
from dsconv.family.layout import Layout
from tests.helpers import Steps, launch_ranks, quantize, shard, window_nll

CONTEXT = 128  # the training sequence length
EVAL_TOKENS = 4096  # held-out tokens scored (32 windows)
PROMPT_TOKENS = 32  # each prompt: BOS + the first tokens of one held-out module
NEW_TOKENS = 64
# Gate thresholds. The trained models are the same bytes on every x86-64 CPU (convert/trained.py, TRAINING_ENV).
# Measured on a 2-core Intel Xeon (AVX-512, AMX), V3.2 with its trained indexer, V4: perplexity +0.11% / +0.13%,
# cosine 0.99982 / 0.99998, top-1 agreement 0.9844 / 0.9969 (630 and 638 of 640)
PERPLEXITY_RELATIVE = 0.01
COSINE_MIN = 0.999  # mean over scored positions of the per-position cosine of the logits
# Top-1 agreement along BF16's greedy text: BF16 continues each of the 10 prompts by 64 tokens, both models read
# prompt + continuation, and we count the 640 continuation positions where W8A8 ranks first the token BF16 ranks
# first. Each position is judged on its own, so a near-tie that a CPU's rounding tips moves the share by 1/640;
# counting matches only up to each sequence's first divergence instead lets one early near-tie drop the rest of
# its sequence, up to a tenth of the whole (V4's 2 differing positions of 640 scored 0.892 that way). Each bound
# sits 9 or 10 positions below what INT8 reaches and above what a 6-bit grid (scale amax/31) reaches: 0.9672 (V3.2,
# 619 of 640) / 0.9625 (V4), where the 6-bit perplexity (+0.21% / +0.48%) and cosine (0.99917 / 0.99983) pass their
# bounds. A 7-bit grid (amax/63) passes all three (V3.2: +0.06%, 0.99962, 0.9859).
AGREEMENT_MIN = {"deepseek_v32": 0.97, "deepseek_v4": 0.98}
RELATIVE_TOLERANCE = 1e-4  # dsrun perplexity against transformers


def heldout_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text).ids for text in heldout_texts()]


def window_logits(shards, cut: list[list[int]], kv_cache_dtype: str = "auto") -> list[torch.Tensor]:
    """Every window's logits [len, vocab] from dsrun's model on one rank, in this process, float32."""
    _, _, model, new_cache = start_rank(str(shards), load_manifest(shards), "float32", "cpu")
    out = []
    with torch.inference_mode():
        for window in cut:
            out.append(Steps(new_cache(len(window), kv_cache_dtype)).forward(model, [(0, window)]).float())
    return out


def greedy_tokens(shards, prompts: list[list[int]], kv_cache_dtype: str = "auto") -> list[list[int]]:
    _, _, model, new_cache = start_rank(str(shards), load_manifest(shards), "float32", "cpu")
    with torch.inference_mode():
        return greedy(model, new_cache(sum(len(p) + NEW_TOKENS for p in prompts), kv_cache_dtype), prompts,
                      NEW_TOKENS, None)


def top1_agreement(bf16, w8a8, prompts: list[list[int]], kv_cache_dtypes=("auto", "auto")) -> float:
    """Share of the positions of BF16's greedy continuations at which W8A8 and BF16, reading the same text, rank
    the same token first (both through the same forward pass, so only the weights differ). Any two sides: each a
    shard set and its --kv-cache-dtype."""
    base_kv, other_kv = kv_cache_dtypes
    texts = [prompt + continuation for prompt, continuation in zip(prompts, greedy_tokens(bf16, prompts, base_kv))]
    matched = scored = 0
    for prompt, base, quant in zip(prompts, window_logits(bf16, texts, base_kv),
                                   window_logits(w8a8, texts, other_kv)):
        predicting = slice(len(prompt) - 1, -1)  # the logits that chose each continuation token
        matched += (base[predicting].argmax(-1) == quant[predicting].argmax(-1)).sum().item()
        scored += base[predicting].shape[0]
    return matched / scored


@pytest.fixture(scope="module")
def gate_shards(trained_source, tmp_path_factory):
    """gate_shards(family) -> (BF16 shards, W8A8 shards), one rank each."""
    cache = {}

    def build(family: str):
        if family not in cache:
            root = tmp_path_factory.mktemp(f"gate-{family}")
            quantize(trained_source(family), root / "w8a8")
            shard(trained_source(family), root / "bf16-shards", Layout(1, 1, 1, 1))
            shard(root / "w8a8", root / "w8a8-shards", Layout(1, 1, 1, 1))
            cache[family] = root / "bf16-shards", root / "w8a8-shards"
        return cache[family]

    return build


def test_encoders_round_trip():
    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(0)) * 0.05
    w[:128, :128] = 0  # an all-zero block
    codes, scale = encode_fp8(w)
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # powers of two (UE8M0)
    decoded = decode_fp8(codes, scale)
    assert (decoded - w).abs().max() <= w.abs().max() * 2 ** -4  # 3 mantissa bits
    assert torch.equal(snap(decoded, Encoding.FP8), decoded)  # encoding decoded values keeps them
    packed, scale4 = encode_fp4(w)
    assert packed.shape == (256, 192) and scale4.shape == (256, 12)
    decoded4 = decode_fp4(packed, scale4)
    assert torch.equal(snap(decoded4, Encoding.FP4), decoded4)
    assert torch.equal(decoded4.bfloat16().float(), decoded4)  # BF16 holds them exactly
    assert (decoded4 - w).abs().max() <= w.abs().max() / 2  # e2m1: 1 mantissa bit, amax within 6 * scale


@pytest.mark.parametrize("family", FAMILIES)
def test_w8a8_accuracy_gate(family, trained_source, gate_shards):
    bf16, w8a8 = gate_shards(family)
    tokenizer = Tokenizer.from_file(str(trained_source(family) / "tokenizer.json"))
    ids = [0] + [t for module in heldout_ids(tokenizer) for t in module][:EVAL_TOKENS - 1]
    cut = windows(ids, CONTEXT)
    base, quant = window_logits(bf16, cut), window_logits(w8a8, cut)
    tokens = sum(len(w) - 1 for w in cut)
    ppl_base = math.exp(sum(window_nll(l, w) for l, w in zip(base, cut)) / tokens)
    ppl_quant = math.exp(sum(window_nll(l, w) for l, w in zip(quant, cut)) / tokens)
    cosines = torch.nn.functional.cosine_similarity(torch.cat(base).double(), torch.cat(quant).double(), dim=-1)

    prompts = [[0] + module[:PROMPT_TOKENS - 1] for module in heldout_ids(tokenizer)]
    assert len(prompts) == len(HELDOUT_MODULES) == 10
    agree = top1_agreement(bf16, w8a8, prompts)
    report = (f"{family}: perplexity bf16 {ppl_base:.4f} w8a8 {ppl_quant:.4f} ({ppl_quant / ppl_base - 1:+.3%}); "
              f"logits cosine mean {cosines.mean():.6f} min {cosines.min():.6f}; top-1 agreement {agree:.4f}")
    print(report)
    assert abs(ppl_quant / ppl_base - 1) <= PERPLEXITY_RELATIVE, report
    assert cosines.mean() >= COSINE_MIN, report
    assert agree >= AGREEMENT_MIN[family], report


# The gate of issue 24 for the INT8 caches and the indexer recipe (V3.2): perplexity within 0.5% of the
# reference side's, and the logits' mean cosine at least 0.999 at every position: each of the 128 positions of a
# window, averaged over CACHE_GATE_WINDOWS held-out windows (longer than the trained model's index_topk = 32, so the
# indexer selects from the 33rd position on). A position's mean needs many windows: over the W8A8 gate's 32, the
# worst of the 128 means is set by one flipped selection (INT8 cache: 0.99857 at one position, every other >= 0.9991;
# over 256 windows the worst is 0.99944). It catches INT8 on a 6-bit grid (amax/31, everywhere) in the cache (worst
# position 0.99880) and in the indexer recipe (0.99850); a 7-bit grid passes both (0.99908, 0.99904).
CACHE_PERPLEXITY_RELATIVE = 0.005
POSITION_COSINE_MIN = 0.999
CACHE_GATE_WINDOWS = 256  # 32,768 of the ~106K held-out tokens


def gate_figures(family: str, trained_source, base: tuple, other: tuple, eval_tokens: int = EVAL_TOKENS) -> dict:
    """base, other: (shards, kv_cache_dtype) -> perplexities, the per-position mean cosine, top-1 agreement, over
    the first eval_tokens held-out tokens."""
    tokenizer = Tokenizer.from_file(str(trained_source(family) / "tokenizer.json"))
    ids = [0] + [t for module in heldout_ids(tokenizer) for t in module][:eval_tokens - 1]
    if len(ids) < eval_tokens:
        raise ValueError(f"the held-out text has {len(ids)} tokens, fewer than the {eval_tokens} asked for")
    cut = [w for w in windows(ids, CONTEXT) if len(w) == CONTEXT]
    ref, new = window_logits(*base[:1], cut, base[1]), window_logits(*other[:1], cut, other[1])
    tokens = sum(len(w) - 1 for w in cut)
    ppl_ref = math.exp(sum(window_nll(l, w) for l, w in zip(ref, cut)) / tokens)
    ppl_new = math.exp(sum(window_nll(l, w) for l, w in zip(new, cut)) / tokens)
    cosines = torch.nn.functional.cosine_similarity(torch.stack(ref).double(), torch.stack(new).double(), dim=-1)
    per_position = cosines.mean(0)  # [CONTEXT]: each position's mean over the windows
    prompts = [[0] + module[:PROMPT_TOKENS - 1] for module in heldout_ids(tokenizer)]
    agree = top1_agreement(base[0], other[0], prompts, (base[1], other[1]))
    return {"ppl_ref": ppl_ref, "ppl_new": ppl_new, "relative": ppl_new / ppl_ref - 1,
            "position_min": per_position.min().item(), "cosine_mean": cosines.mean().item(), "agreement": agree,
            "windows": len(cut)}


def _gate_report(name: str, figures: dict) -> str:
    return (f"{name}: perplexity {figures['ppl_ref']:.4f} -> {figures['ppl_new']:.4f} ({figures['relative']:+.3%}) "
            f"over {figures['windows']} windows; logits cosine mean {figures['cosine_mean']:.6f}, worst position "
            f"{figures['position_min']:.6f}; top-1 agreement {figures['agreement']:.4f}")


def assert_cache_gate(name: str, trained_source, base: tuple, other: tuple) -> None:
    """Issue 24's gate (above) for two (shards, kv_cache_dtype) sides of the trained V3.2, over the gate's windows."""
    figures = gate_figures("deepseek_v32", trained_source, base, other, CACHE_GATE_WINDOWS * CONTEXT)
    report = _gate_report(name, figures)
    print(report)
    assert abs(figures["relative"]) <= CACHE_PERPLEXITY_RELATIVE, report
    assert figures["cosine_mean"] >= COSINE_MIN, report
    assert figures["position_min"] >= POSITION_COSINE_MIN, report


def test_int8_kv_cache_gate(trained_source, gate_shards):
    """--kv-cache-dtype int8 against auto on the trained V3.2 (BF16 weights, float32 compute): the INT8 latent
    and the A8C8 indexer alone."""
    bf16, _ = gate_shards("deepseek_v32")
    assert_cache_gate("deepseek_v32 int8 KV cache", trained_source, (bf16, "auto"), (bf16, "int8"))


def test_indexer_recipe_gate(trained_source, gate_shards, tmp_path):
    """Recipe v32-indexer (the indexer's wq_b in W8A8 too) against recipe v3, both W8A8, float32 compute."""
    _, w8a8 = gate_shards("deepseek_v32")
    quantize(trained_source("deepseek_v32"), tmp_path / "indexer", recipe="v32-indexer")
    shard(tmp_path / "indexer", tmp_path / "indexer-shards", Layout(1, 1, 1, 1))
    assert_cache_gate("deepseek_v32 recipe v32-indexer vs v3", trained_source, (w8a8, "auto"),
                      (tmp_path / "indexer-shards", "auto"))


def transformers_perplexity(model, cut: list[list[int]]) -> tuple[float, int]:
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for window in cut:
            logits = model(torch.tensor([window])).logits[0]
            nll += window_nll(logits.double(), window)
            tokens += len(window) - 1
    return math.exp(nll / tokens), tokens


@pytest.mark.slow
@pytest.mark.parametrize("family,layout", [
    ("deepseek_v32", Layout(1, 1, 1, 1)),
    ("deepseek_v32", Layout(16, 16, 16, 8)),
    ("deepseek_v4", Layout(1, 1, 1, 1)),
    ("deepseek_v4", Layout(16, 16, 16, 1)),
])
def test_trained_perplexity_equals_transformers(family, layout, trained_source, tmp_path):
    shards = tmp_path / "shards"
    shard(trained_source(family), shards, layout)
    reference = AutoModelForCausalLM.from_pretrained(trained_source(family, "bf16"), dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(trained_source(family) / "tokenizer.json"))
    ids = [0] + heldout_ids(tokenizer)[0][:CONTEXT * 3 - 20]
    for context in (CONTEXT * 4, CONTEXT):  # one window; three
        cut = windows(ids, context)
        assert len(cut) == (1 if context > CONTEXT else 3)
        records = launch_ranks("dsconv.runner.entrypoints.perplexity:rank_main", {"windows": cut, "dtype": "float32"}, shards,
                               tmp_path / f"results-{context}")
        ours = summarize(records)
        expected, tokens = transformers_perplexity(reference, cut)
        assert ours["tokens"] == tokens
        assert abs(ours["perplexity"] - expected) <= RELATIVE_TOLERANCE * expected, (ours, expected)
