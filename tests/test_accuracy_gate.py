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
# Gate thresholds. The trained models are the same bytes on every x86-64 CPU (convert/trained.py, TRAINING_ENV) and
# measured, with ATen's AVX-512, AVX2 and baseline kernels alike: perplexity -0.03% (V3.2) / +0.14% (V4), cosine
# 0.99942 / 0.99998, top-1 agreement 0.9766 / 0.9969 (625 and 638 of 640)
PERPLEXITY_RELATIVE = 0.01
COSINE_MIN = 0.999  # mean over scored positions of the per-position cosine of the logits
# Top-1 agreement along BF16's greedy text: BF16 continues each of the 10 prompts by 64 tokens, both models read
# prompt + continuation, and we count the 640 continuation positions where W8A8 ranks first the token BF16 ranks
# first. Each position is judged on its own, so a near-tie that a CPU's rounding tips moves the share by 1/640;
# counting matches only up to each sequence's first divergence instead lets one early near-tie drop the rest of
# its sequence, up to a tenth of the whole (V4's 2 differing positions of 640 scored 0.892 that way). Each bound
# sits about 10 positions below what INT8 reaches and above what a 6-bit grid (scale amax/31) reaches: 0.9500 /
# 0.9625, where V4's 6-bit perplexity (+0.48%) and cosine (0.99983) pass their bounds. V3.2 agrees less than V4;
# the likely cause (not isolated): its indexer keeps 8 keys (index_topk=8), and a key that INT8 error moves across
# that cut changes the attention.
AGREEMENT_MIN = {"deepseek_v32": 0.96, "deepseek_v4": 0.98}
RELATIVE_TOLERANCE = 1e-4  # dsrun perplexity against transformers


def heldout_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text).ids for text in heldout_texts()]


def window_logits(shards, cut: list[list[int]]) -> list[torch.Tensor]:
    """Every window's logits [len, vocab] from dsrun's model on one rank, in this process, float32."""
    _, _, model, new_cache = start_rank(str(shards), load_manifest(shards), "float32", "cpu")
    out = []
    with torch.inference_mode():
        for window in cut:
            out.append(Steps(new_cache(len(window))).forward(model, [(0, window)]).float())
    return out


def greedy_tokens(shards, prompts: list[list[int]]) -> list[list[int]]:
    _, _, model, new_cache = start_rank(str(shards), load_manifest(shards), "float32", "cpu")
    with torch.inference_mode():
        return greedy(model, new_cache(sum(len(p) + NEW_TOKENS for p in prompts)), prompts, NEW_TOKENS, None)


def top1_agreement(bf16, w8a8, prompts: list[list[int]]) -> float:
    """Share of the positions of BF16's greedy continuations at which W8A8 and BF16, reading the same text, rank
    the same token first (both through the same forward pass, so only the weights differ)."""
    texts = [prompt + continuation for prompt, continuation in zip(prompts, greedy_tokens(bf16, prompts))]
    matched = scored = 0
    for prompt, base, quant in zip(prompts, window_logits(bf16, texts), window_logits(w8a8, texts)):
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
