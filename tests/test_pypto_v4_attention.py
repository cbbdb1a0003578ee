"""The PyPTO kernel of DeepSeek-V4's decode attention (kernels/pypto/v4_attention.py) through PyPTO 0.2.0's
pass-verify interpreter on the host, against the torch path: kernels.attention.attention_reference(q, keys, keys,
scale, allowed[:, None], sinks=sinks, one_token=True), what runner/models/deepseek_v4.py's Attention.decode calls.

Float32 within FLOAT32_TOLERANCE at a tiny shape, the tiny fixture's (4 heads of 128, its 16-key window and
index_topk 8 entries) and V4-Flash's real decode (64 heads a rank, head_dim 512, a 128-key window and 512 selected
entries); BF16 within one rounding of the float32 formula's output, and near the BF16 torch path; a wrong
variant (the sink left out, the keys scored one position off) far outside."""

import pytest
import torch

from dsconv.kernels.attention import attention_reference
from dsconv.kernels.pypto.v4_attention import v4_decode_attention

pytestmark = pytest.mark.usefixtures("pypto_deferred_checks")

FLOAT32_TOLERANCE = 1e-5  # measured: 4.6e-7 (tiny), 5.1e-7 (tiny fixture), 3.3e-7 (V4-Flash)
BF16_HALF_ULP = 2 ** -8  # relative: one rounding to BF16 (8 bits of mantissa)
# against the BF16 torch path, which rounds its output too, and before that its scores and its probabilities: each
# output is a weighted mean of value rows (the weights sum to at most 1), so the probabilities' rounding errors scale
# with the values; bound: 2 half ULPs of the largest value (measured: 0.49 at the tiny shape, 0.64 at V4-Flash's)
BF16_TORCH_PATH_TOLERANCE = 2 * BF16_HALF_ULP
WRONG_MARGIN = 1e-2  # 1,000 float32 tolerances: a wrong variant's error is at least this (measured: 0.20, 1.6)
MASKED_SHARE = 0.3  # of the keys, masked at random

# (batch, heads, head_dim, window, selected entries)
SHAPES = {"tiny": (2, 4, 128, 16, 5), "tiny-fixture": (3, 4, 128, 16, 8), "v4-flash": (1, 64, 512, 128, 512)}


def inputs(batch, heads, dim, window, selected, dtype=torch.float32, seed=0):
    """q [B, H, D], keys [B, K, D], allowed [B, K], sinks [H]: random, a share of the keys masked; the first
    sequence's window only partly filled (an early decode step: its first positions not yet written)."""
    gen = torch.Generator().manual_seed(seed)
    keys_n = window + selected
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    keys = torch.randn(batch, keys_n, dim, generator=gen).to(dtype)
    allowed = torch.rand(batch, keys_n, generator=gen) > MASKED_SHARE
    allowed[0, :window // 2] = False
    return q, keys, allowed, torch.randn(heads, generator=gen)


def reference(q, keys, allowed, sinks):
    return attention_reference(q, keys, keys, q.shape[-1] ** -0.5, allowed[:, None], sinks=sinks, one_token=True)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_float32_equals_the_torch_path(shape):
    q, keys, allowed, sinks = inputs(*SHAPES[shape])
    out = v4_decode_attention(q, keys, allowed, sinks, q.shape[-1] ** -0.5)
    assert out.shape == q.shape and out.dtype == torch.float32
    assert (out - reference(q, keys, allowed, sinks)).abs().max().item() <= FLOAT32_TOLERANCE


@pytest.mark.parametrize("shape", ["tiny", "v4-flash"])
def test_bf16_within_its_rounding(shape):
    q, keys, allowed, sinks = inputs(*SHAPES[shape], dtype=torch.bfloat16)
    out = v4_decode_attention(q, keys, allowed, sinks, q.shape[-1] ** -0.5)
    assert out.dtype == torch.bfloat16
    # the float32 formula on the same BF16 inputs: the kernel's one rounding of its output
    exact = reference(q.float(), keys.float(), allowed, sinks)
    assert torch.allclose(out.float(), exact, rtol=BF16_HALF_ULP, atol=FLOAT32_TOLERANCE)
    torch_path = reference(q, keys, allowed, sinks).float()
    bound = BF16_TORCH_PATH_TOLERANCE * keys.float().abs().max().item()
    assert (out.float() - torch_path).abs().max().item() <= bound


def test_a_sequence_allowing_no_key_gets_zeros():
    """Its sinks take all the probability, as in the torch path."""
    q, keys, allowed, sinks = inputs(*SHAPES["tiny"])
    allowed[1] = False
    out = v4_decode_attention(q, keys, allowed, sinks, q.shape[-1] ** -0.5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert (out - reference(q, keys, allowed, sinks)).abs().max().item() <= FLOAT32_TOLERANCE


@pytest.mark.parametrize("wrong", ["no_sink", "shifted"])
def test_a_wrong_attention_fails(wrong):
    """The sink left out of the softmax, or each key scored with its neighbour's row: far outside the tolerance."""
    q, keys, allowed, sinks = inputs(*SHAPES["tiny"])
    out = v4_decode_attention(q, keys, allowed, sinks, q.shape[-1] ** -0.5, wrong)
    assert (out - reference(q, keys, allowed, sinks)).abs().max().item() > WRONG_MARGIN


def test_an_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="wrong='typo'"):
        v4_decode_attention(*inputs(*SHAPES["tiny"]), 1.0, "typo")
