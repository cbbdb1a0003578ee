"""DeepSeek-V3.2's decode attention kernels in PyPTO (kernels/pypto/indexer.py, kernels/pypto/sparse_mla.py) through
PyPTO 0.2.0's pass-verify interpreter on the host, against the runner's torch path:
- the lightning indexer: the same positions as runner/models/deepseek_v3.py's `Indexer.select_decode` arithmetic
  (float keys, and A8C8 over an INT8 key cache), ties toward the lowest position, at the tiny fixture's shape and at
  V3.2's decode size (64 index heads of 128 over 8K positions, top 2048);
- the absorbed sparse MLA: `kernels.attention.attention_reference` over the chosen latent rows, auto and INT8 cache,
  float32 within 1e-5, at the tiny shape and at V3.2's 128 heads, 512 + 64 latent, top-k 2048 of an 8K cache;
- a deliberately wrong variant of each fails."""

import pytest
import torch

from dsconv.kernels.attention import attention_reference
from dsconv.kernels.cache_int8 import dequantize_tokens, int8_scores, quantize_tokens
from dsconv.kernels.pypto.indexer import indexer_topk
from dsconv.kernels.pypto.sparse_mla import sparse_mla_decode
from dsconv.kernels.topk import topk_lowest_index

pytestmark = pytest.mark.usefixtures("pypto_deferred_checks")

FLOAT32_TOLERANCE = 1e-5


def index_reference(q, head_weights, keys, key_scales, slots, valid, k):
    """`Indexer.select_decode`'s arithmetic on these tensors: the top k positions, ties toward the lowest."""
    heads, dim = q.shape[1:]
    if keys.dtype == torch.int8:
        scores = int8_scores(*quantize_tokens(q), keys[slots], key_scales[slots])
    else:
        scores = torch.bmm(q, keys[slots].transpose(1, 2))
    index = torch.bmm((head_weights * heads ** -0.5)[:, None], scores.mul(dim ** -0.5).relu())[:, 0]
    return topk_lowest_index(index if valid is None else index.masked_fill(~valid, float("-inf")), k)


def indexer_inputs(batch, heads, dim, cache_slots, context, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, head_weights = torch.randn(batch, heads, dim, generator=gen), torch.randn(batch, heads, generator=gen)
    keys = torch.randn(cache_slots, dim, generator=gen)
    slots = torch.stack([torch.randperm(cache_slots, generator=gen)[:context] for _ in range(batch)])
    return q, head_weights, keys, slots


def same_positions(got, expected) -> bool:
    """The kernel lists a row's positions lowest first, the torch path best first: the same set."""
    return torch.equal(got.sort(-1).values, expected.sort(-1).values)


@pytest.mark.parametrize("cache", ["auto", "int8"])
def test_indexer_picks_the_torch_paths_positions(cache):
    """Two sequences, 4 heads of 64, 40 positions (the last three of one padded), top 8."""
    q, head_weights, keys, slots = indexer_inputs(2, 4, 64, 64, 40)
    valid = torch.ones(2, 40, dtype=torch.bool)
    valid[0, -3:] = False
    key_scales = None
    if cache == "int8":
        keys, key_scales = quantize_tokens(keys)
    got = indexer_topk(q, head_weights, keys, key_scales, slots, valid, 8)
    assert same_positions(got, index_reference(q, head_weights, keys, key_scales, slots, valid, 8))


def test_indexer_breaks_ties_toward_the_lowest_position():
    """Positive head weights and keys repeated: many positions score exactly alike, across the k-th."""
    q, head_weights, keys, _ = indexer_inputs(1, 4, 64, 8, 8, seed=3)
    head_weights = head_weights.abs()
    slots = torch.arange(8).repeat(5)[None]  # 40 positions reading 8 keys: every score five times
    got = indexer_topk(q, head_weights, keys, None, slots, None, 12)
    expected = index_reference(q, head_weights, keys, None, slots, None, 12)
    assert same_positions(got, expected)


def test_indexer_at_v32_decode_size():
    """V3.2's decode: 64 index heads of 128, A8C8 over 8,192 cached positions (of a 9,000-slot cache), top 2,048
    (the kernel takes the k-th in two rounds of its largest topk, 1,024)."""
    q, head_weights, keys, slots = indexer_inputs(1, 64, 128, 9000, 8192)
    keys, key_scales = quantize_tokens(keys)
    got = indexer_topk(q, head_weights, keys, key_scales, slots, None, 2048)
    assert same_positions(got, index_reference(q, head_weights, keys, key_scales, slots, None, 2048))


def test_a_wrong_indexer_fails():
    """Every position scored as the next one: other positions."""
    q, head_weights, keys, slots = indexer_inputs(2, 4, 64, 64, 40)
    got = indexer_topk(q, head_weights, keys, None, slots, None, 8, wrong="shifted")
    assert not same_positions(got, index_reference(q, head_weights, keys, None, slots, None, 8))


def mla_inputs(batch, heads, lora, rope, cache_slots, chosen, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, lora + rope, generator=gen)
    latent = torch.randn(cache_slots, lora + rope, generator=gen)
    slots = torch.stack([torch.randperm(cache_slots, generator=gen)[:chosen] for _ in range(batch)])
    return query, latent, slots


def mla_case(query, latent, slots, valid, lora, cache):
    """(the kernel's cache dict, the rows the torch path reads: dequantized as the cache's read_slots does)."""
    if cache == "auto":
        return {"c_kv_k_pe": latent}, latent
    codes, scales = quantize_tokens(latent[:, :lora])
    stored = {"c_kv_k_pe.int8": codes, "c_kv_k_pe.scale": scales, "c_kv_k_pe.rest": latent[:, lora:]}
    return stored, torch.cat([dequantize_tokens(codes, scales, latent.dtype), latent[:, lora:]], -1)


def mla_reference(query, rows, slots, valid, lora, scale):
    ctx = rows[slots]  # [B, K, lora + rope]
    return attention_reference(query, ctx, ctx[..., :lora], scale, None if valid is None else valid[:, None],
                               one_token=True)


# (batch, heads, lora, rope, cache slots, chosen): the trained tiny V3.2's (8 heads, latent 128 + rope 128, top 32),
# and V3.2's real decode (128 heads, 512 + 64, top-k 2048 of an 8K cache)
MLA_SHAPES = {"tiny": (2, 8, 128, 128, 64, 32), "real": (1, 128, 512, 64, 8192, 2048)}


@pytest.mark.parametrize("cache", ["auto", "int8"])
@pytest.mark.parametrize("shape", list(MLA_SHAPES))
def test_sparse_mla_equals_the_torch_path(shape, cache):
    batch, heads, lora, rope, cache_slots, chosen = MLA_SHAPES[shape]
    query, latent, slots = mla_inputs(batch, heads, lora, rope, cache_slots, chosen)
    valid = torch.ones(batch, chosen, dtype=torch.bool)
    valid[0, -2:] = False  # a context shorter than k: its padded picks are invalid
    stored, rows = mla_case(query, latent, slots, valid, lora, cache)
    scale = (lora + rope) ** -0.5
    got = sparse_mla_decode(query, stored, slots, valid, lora, scale)
    assert (got - mla_reference(query, rows, slots, valid, lora, scale)).abs().max().item() <= FLOAT32_TOLERANCE


@pytest.mark.parametrize("wrong,cache", [("no_scale", "int8"), ("no_scale", "auto"), ("shifted", "auto")])
def test_a_wrong_sparse_mla_fails(wrong, cache):
    """The INT8 rows' scales (or the softmax scale) left out, or every position scored with its neighbour's row."""
    batch, heads, lora, rope, cache_slots, chosen = MLA_SHAPES["tiny"]
    query, latent, slots = mla_inputs(batch, heads, lora, rope, cache_slots, chosen)
    stored, rows = mla_case(query, latent, slots, None, lora, cache)
    scale = (lora + rope) ** -0.5
    got = sparse_mla_decode(query, stored, slots, None, lora, scale, wrong=wrong)
    assert (got - mla_reference(query, rows, slots, None, lora, scale)).abs().max().item() > 0.1
